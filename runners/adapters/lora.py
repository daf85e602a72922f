"""LoRA adapters on a built artifact, through its weight provenance (`runners/adapters/provenance.py`).

An adapter file holds, per adapted layer, a low-rank pair: `down` (rank, in[, kh, kw]) and `up`
(out, rank[, 1, 1]). The layer's weight changes by `scale * alpha / rank * up @ down`. Formats read:
- diffusers / PEFT: `<component>.<module>.lora_A.weight` and `lora_B.weight` (also with PEFT's
  `base_layer` and adapter-name segments), alpha and rank from the file's `lora_adapter_metadata`
  (diffusers' save functions write it) or per-module `.alpha` tensors; alpha = rank without either;
- kohya: `lora_unet_<module_with_underscores>.lora_down.weight` / `lora_up.weight` / `alpha`
  (`lora_te_`, `lora_te1_`, `lora_te2_` for the text encoders);
- a family's own spellings, which its package turns into diffusers' for its artifacts (`register_key_spelling`):
  FLUX.1's and FLUX.2's original module names (kohya's, ComfyUI's and ai-toolkit's `diffusion_model.`:
  runners/adapters/original_names.py), Z-Image's.

The changed weight of every initializer an adapter touches is computed from the artifact's own
(an fp16 one in float32, rounded once; an int8 or fp8 one dequantized, then quantized again with its
scales computed afresh: runners/adapters/quantized.py), each fused slice at its place. Numpy only: a deployed
runner applies adapters without torch.
"""
from __future__ import annotations

import json
import re
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runners.adapters.provenance import WeightTable
from runners.adapters.quantized import STORAGE, dequantize, quantize

# kohya's prefixes: the component each names (SD1.5's one text encoder is lora_te, SDXL's are te1/te2).
KOHYA_PREFIXES = {"lora_unet_": "unet", "lora_transformer_": "transformer", "lora_te_": "text_encoder",
                  "lora_te1_": "text_encoder", "lora_te2_": "text_encoder_2", "lora_te3_": "text_encoder_3"}
_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}
# {adapter tensors} -> the same with a family's own key spellings as diffusers' PEFT keys (others as they
# are): registered by the families (runners/families/<name>/), applied to every adapter read.
KEY_SPELLINGS: dict[str, list] = {}  # {family: its converters}


def register_key_spelling(family: str, convert) -> None:
    """Have every adapter read for an artifact of `family` turn the family's own key spellings into diffusers'
    with `convert` (FLUX.1's and FLUX.2's original names are alike, their diffusers modules are not)."""
    converters = KEY_SPELLINGS.setdefault(family, [])
    if convert not in converters:
        converters.append(convert)


class LoraError(ValueError):
    """An adapter that cannot be applied: which file, which keys, and why."""


@dataclass(frozen=True)
class Layer:
    component: str
    module: str  # the module's path in its component: "transformer_blocks.0.attn.to_q"
    down: np.ndarray  # (rank, in) or (rank, in, kh, kw)
    up: np.ndarray  # (out, rank) or (out, rank, 1, 1)
    alpha: float

    @property
    def key(self) -> str:
        return f"{self.module}.weight"

    def delta(self, scale: float = 1.0) -> np.ndarray:
        """The weight's change at `scale`, in the checkpoint's layout (out, in[, kh, kw]), float32.
        The product is taken in float64 and rounded once: a float32 product's rounding depends on the
        BLAS kernel (numpy 1's OpenBLAS in the Triton stub and numpy 2's here differed by a level of
        255 on an AMX Xeon), while each float64 term is exact and the sum's error stays far below
        float32's, so every process on every CPU gets the same weights."""
        rank = self.down.shape[0]
        up = self.up.reshape(self.up.shape[0], rank).astype(np.float64)
        change = up @ self.down.reshape(rank, -1).astype(np.float64)
        change *= float(scale) * self.alpha / rank
        return change.astype(np.float32).reshape((self.up.shape[0],) + self.down.shape[1:])


def read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors as float32 arrays, the header's metadata) of a .safetensors file."""
    data = Path(path).read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, t in header.items():
        start, end = (8 + size + o for o in t["data_offsets"])
        raw = data[start:end]
        if t["dtype"] == "BF16":  # bfloat16 is float32's upper half
            array = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif t["dtype"] in _DTYPES:
            array = np.frombuffer(raw, _DTYPES[t["dtype"]]).astype(np.float32)
        else:
            raise LoraError(f"{path}: tensor {name} has dtype {t['dtype']}; adapters are read in "
                            f"{', '.join(['BF16', *_DTYPES])}")
        tensors[name] = array.reshape(t["shape"])
    return tensors, metadata


def read_adapter(path: Path, parameters: set[tuple[str, str]], unread: set[tuple[str, str]] = frozenset(),
                 ignore_unmatched: bool = False, family: str | None = None) -> list[Layer]:
    """The adapter's layers, each named by the (component, module) whose weight it changes.
    `parameters` are the (component, checkpoint key) pairs the artifact holds; a layer on one of
    `unread` (weights no engine reads) cannot change an image and is skipped with a warning. A key
    that matches neither is an error listing them all, unless `ignore_unmatched`. `family`: the artifact's,
    whose own key spellings are read too."""
    path = Path(path)
    if not path.is_file():
        raise LoraError(f"adapter {path} does not exist")
    tensors, metadata = read_safetensors(path)
    for convert in KEY_SPELLINGS.get(family, ()):  # the family's own spellings (FLUX.1's original names...)
        tensors = convert(tensors)
    kohya = _kohya_names(parameters | unread)
    pairs: dict[tuple[str, str], dict] = {}
    unmatched, skipped = [], []
    for name, array in tensors.items():
        parsed = _parse_key(name, kohya)
        spellings = _spellings(parsed[1]) if parsed else []
        module = next((m for m in spellings if (parsed[0], f"{m}.weight") in parameters), None)
        if module is not None:
            pairs.setdefault((parsed[0], module), {})[parsed[2]] = array
        elif any((parsed[0], f"{m}.weight") in unread for m in spellings):
            skipped.append(name)
        else:
            unmatched.append(name)
    if skipped:
        warnings.warn(f"{path}: {len(skipped)} keys change weights that no engine of this artifact reads (the "
                      f"pipeline does not use those layers), so they cannot change an image: {skipped[0]} ...")
    if unmatched and not ignore_unmatched:
        shown = ", ".join(unmatched[:10]) + (f" and {len(unmatched) - 10} more" if len(unmatched) > 10 else "")
        raise LoraError(f"{path}: {len(unmatched)} keys match no weight of this artifact: {shown}. Is the adapter "
                        f"for this model? (ignore_unmatched / --ignore-unmatched skips them, and says how many)")
    if unmatched:
        warnings.warn(f"{path}: skipped {len(unmatched)} keys that match no weight of this artifact "
                      f"(ignore_unmatched): {', '.join(unmatched[:5])}{' ...' if len(unmatched) > 5 else ''}")
    config = json.loads(metadata.get("lora_adapter_metadata", "{}"))
    layers = []
    for (component, module), roles in sorted(pairs.items()):
        if "down" not in roles or "up" not in roles:
            raise LoraError(f"{path}: {component}.{module} has {' and '.join(sorted(roles))} but not both "
                            f"lora_A/lora_down and lora_B/lora_up")
        rank = roles["down"].shape[0]
        alpha = roles.get("alpha")
        alpha = float(alpha.reshape(-1)[0]) if alpha is not None else _configured_alpha(config, component, module, rank)
        layers.append(Layer(component, module, roles["down"], roles["up"], alpha))
    if not layers and not skipped:
        raise LoraError(f"{path}: no LoRA layer found (keys like <component>.<module>.lora_A.weight, or kohya's "
                        f"lora_unet_<module>.lora_down.weight)")
    return layers


_PEFT = re.compile(r"^(?P<path>.+?)\.(?:base_layer\.)?(?P<role>lora_A|lora_B|lora_down|lora_up|alpha)"
                   r"(?:\.[A-Za-z0-9_-]+)?(?:\.weight)?$")
_ROLES = {"lora_A": "down", "lora_down": "down", "lora_B": "up", "lora_up": "up", "alpha": "alpha"}


def _parse_key(name: str, kohya: dict[str, tuple[str, str]]) -> tuple[str, str, str] | None:
    """(component, module, down|up|alpha) of one adapter key, or None."""
    match = _PEFT.match(name)
    if match is None:
        return None
    path, role = match["path"].replace(".base_layer", ""), _ROLES[match["role"]]
    if path in kohya:
        return (*kohya[path], role)
    component, _, module = path.partition(".")
    return (component, module, role) if module else None


def _spellings(module: str) -> list[str]:
    """A module's path as an adapter may spell it: CLIP's checkpoints name their layers with a
    `text_model.` prefix or without it (transformers 5 saves them without), and adapters follow
    the checkpoint they were trained on."""
    if module.startswith("text_model."):
        return [module, module[len("text_model."):]]
    return [module, f"text_model.{module}"]


def _kohya_names(parameters) -> dict[str, tuple[str, str]]:
    """{kohya layer name: (component, module)} for every weight the artifact holds. kohya's trainers name
    any denoiser `lora_unet_`: a transformer's too, where the artifact has no U-Net (Z-Image's adapters)."""
    prefixes = dict(KOHYA_PREFIXES)
    if all(component != "unet" for component, _ in parameters):
        prefixes["lora_unet_"] = "transformer"
    names = {}
    for component, key in parameters:
        if key.endswith(".weight"):
            module = key[:-len(".weight")]
            for prefix, named in prefixes.items():
                if named == component:
                    for spelling in _spellings(module):
                        names[prefix + spelling.replace(".", "_")] = (component, module)
    return names


def _configured_alpha(config: dict, component: str, module: str, rank: int) -> float:
    """PEFT's alpha for a module: its alpha_pattern entry, else lora_alpha (rsLoRA folded in), else
    the rank (diffusers' default when a file records none: scale 1)."""
    def setting(name, default=None):
        return config.get(f"{component}.{name}", config.get(name, default))

    alpha = setting("lora_alpha", rank)
    for pattern, value in (setting("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?({pattern})", module):
            alpha = value
    if setting("use_rslora", False):  # scaling alpha / sqrt(r), written as (alpha * sqrt(r)) / r
        alpha = alpha * rank ** 0.5
    return float(alpha)


def parse_lora_spec(text: str) -> tuple[str, float]:
    """"PATH[:SCALE]" -> (PATH, SCALE); scale 1 without one."""
    path, sep, scale = text.rpartition(":")
    if sep and path and re.fullmatch(r"[-+]?\d*\.?\d+(e[-+]?\d+)?", scale.strip(), re.I):
        return path, float(scale)
    return text, 1.0


def weight_deltas(loras: dict, parameters: set, unread: set = frozenset(), ignore_unmatched: bool = False,
                  family: str | None = None) -> dict[tuple[str, str], np.ndarray]:
    """{(component, checkpoint key): the sum of the adapters' changes, each at its scale}, summed in one
    order whatever the order of `loras` (`in_merge_order`), so that a server and `Pipeline.load` that
    name the same set get the same weights bit for bit."""
    deltas: dict[tuple[str, str], np.ndarray] = {}
    for path, scale in in_merge_order(loras):
        for layer in read_adapter(path, parameters, unread, ignore_unmatched, family):
            key = (layer.component, layer.key)
            change = layer.delta(scale)
            deltas[key] = deltas[key] + change if key in deltas else change
    return deltas


def in_merge_order(loras: dict) -> list[tuple[str, float]]:
    """`loras` ({path: scale}) as [(path, scale)] in the order every merge of adapters takes them: by the
    resolved file path (a float sum depends on its order; a server names files by their resolved paths,
    a user by any)."""
    return sorted(loras.items(), key=lambda item: (str(Path(item[0]).resolve()), item[1]))


def adapted(table: WeightTable, deltas: dict, base) -> dict[str, np.ndarray]:
    """{initializer name: its adapted value} for the initializers of `table` the deltas touch.
    `base(name, record)` reads an initializer's values as the artifact holds them."""
    out = {}
    for name, record in table.items():
        touched = [p for p in record["parts"] if (p["component"], p["key"]) in deltas]
        if not touched:
            continue
        whole = [p for p in record["parts"] if "axis" not in p]
        if len(whole) > 1:  # the exporter merged equal parameters into one initializer
            raise LoraError(f"{name} holds {', '.join(p['key'] for p in whole)}, which were equal and share it: "
                            f"an adapter cannot change one of them alone")
        quantized = record.get("quantized")
        if quantized:  # dequantized, changed, and quantized again with its scales computed afresh
            scale = quantized["scale"]
            if scale not in table:
                raise LoraError(f"{name} is quantized ({record['dtype']}) and its scales are not tracked (built "
                                f"before adapters reached quantized artifacts): rebuild it with `python -m engines`")
            value = dequantize(base(name, record), base(scale, table[scale]), quantized["axis"], record["dtype"])
        else:
            value = np.array(base(name, record), dtype=np.float32)
        for part in touched:
            change = deltas[(part["component"], part["key"])]
            if part.get("perm"):
                change = np.transpose(change, part["perm"])
            index = (slice(None),) * part["axis"] + (slice(part["start"], part["stop"]),) if "axis" in part else ()
            if value[index].shape != change.shape:
                raise LoraError(f"{part['component']}.{part['key']}: the adapter's change has shape {change.shape}, "
                                f"the weight {value[index].shape}: the adapter is for another model")
            value[index] += change
        if quantized:
            out[name], out[quantized["scale"]] = quantize(value, quantized["axis"], record["dtype"],
                                                          quantized.get("codes", 127))
        else:
            out[name] = value.astype(np.dtype(record["dtype"]))
    return out


def artifact_weights(folder: Path):
    """`adapted`'s `base` for an artifact whose engines keep their weights in external data: each
    read from its recorded place in the file, without loading the graph."""
    def base(name: str, record: dict) -> np.ndarray:
        location = record.get("location")
        if location is None:
            raise LoraError(f"{folder}: the values of weight {name} are not kept beside its engine, where adapters "
                            f"change them: a TensorRT artifact takes adapters when built with --refittable")
        return np.fromfile(Path(folder) / location["file"], dtype=STORAGE.get(record["dtype"], record["dtype"]),
                           count=int(np.prod(record["shape"])), offset=location["offset"]).reshape(record["shape"])

    return base


def base_values(folder: Path, manifest: dict, submodule: str, names) -> dict[str, np.ndarray]:
    """{name: the artifact's own values} of weights `names` of `submodule`: what a refit puts back
    where an adapter no longer changes a weight."""
    if not names:
        return {}
    table = submodule_tables(folder, {"submodules": {submodule: manifest["submodules"][submodule]}})[submodule]
    base = artifact_weights(folder)
    return {name: base(name, table[name]) for name in names}


def submodule_tables(folder: Path, manifest: dict) -> dict[str, WeightTable]:
    """{submodule: its weight table} for the submodules that have one."""
    return {name: WeightTable.load(Path(folder) / sub["weights_file"])
            for name, sub in manifest["submodules"].items() if sub.get("weights_file")}


def adapted_submodules(folder: Path, manifest: dict, loras: dict,
                       ignore_unmatched: bool = False) -> dict[str, dict[str, np.ndarray]]:
    """{submodule: {initializer: adapted value}} for `loras` ({path: scale}) on the artifact."""
    if not loras:
        return {}
    tables = submodule_tables(folder, manifest)
    if not tables:
        raise LoraError(f"{folder} records no weight provenance (built before adapters were supported): rebuild it "
                        f"with `python -m engines`")
    parameters = set().union(*(t.parameters() for t in tables.values()))
    unread = set().union(*(t.unread for t in tables.values())) - parameters
    deltas = weight_deltas(loras, parameters, unread, ignore_unmatched, manifest["model"]["family"])
    base = artifact_weights(folder)
    changed = {name: adapted(table, deltas, base) for name, table in tables.items()}
    return {name: weights for name, weights in changed.items() if weights}

