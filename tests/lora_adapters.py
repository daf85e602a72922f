"""Test LoRA adapters: made with peft on a tiny pipeline's own modules (random adapter weights),
saved by diffusers' save functions, and converted to kohya's format by a script of the tests'
own (not our reader's code), so that the reader is checked against independent files."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

# The modules each adapter changes, by component (peft's target_modules: name suffixes).
ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
CLIP_ATTENTION = ["q_proj", "k_proj", "v_proj", "out_proj"]


def make_adapter(pipeline_cls, folder, out: Path, targets: dict[str, list[str]], seed: int, rank: int = 4,
                 alpha: float = 8.0, **components) -> Path:
    """An adapter for `targets` ({component: target modules}) of the tiny pipeline in `folder` (with
    `components` given to from_pretrained: a processor it cannot load), saved with
    `pipeline_cls.save_lora_weights` (diffusers/PEFT format, with its adapter metadata)."""
    import torch
    from peft import LoraConfig, get_peft_model_state_dict

    torch.manual_seed(seed)
    pipe = pipeline_cls.from_pretrained(folder, **components)
    layers, metadata = {}, {}
    for component, modules in targets.items():
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, init_lora_weights=False)
        getattr(pipe, component).add_adapter(config)
        # peft's random init is on the scale of the weights: a visible but not overwhelming change
        for name, p in getattr(pipe, component).named_parameters():
            if "lora_" in name:
                p.data = 0.3 * torch.randn_like(p)
        layers[f"{component}_lora_layers"] = get_peft_model_state_dict(getattr(pipe, component))
        metadata[f"{component}_lora_adapter_metadata"] = config.to_dict()
    pipeline_cls.save_lora_weights(out, **layers, **metadata)
    return Path(out) / "pytorch_lora_weights.safetensors"


def read_raw(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    data = Path(path).read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    metadata = header.pop("__metadata__", {})
    return {k: np.frombuffer(data[8 + size + v["data_offsets"][0]:8 + size + v["data_offsets"][1]],
                             np.float32).reshape(v["shape"]) for k, v in header.items()}, metadata


def write_raw(path: Path, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> Path:
    from safetensors.numpy import save_file

    save_file({k: np.asarray(v, np.float32) for k, v in tensors.items()}, str(path), metadata=metadata)
    return Path(path)


def to_kohya(peft_file: Path, out: Path, prefixes: dict[str, str]) -> Path:
    """kohya's format of a diffusers-saved adapter: `lora_unet_<module with _>.lora_down.weight`,
    `.lora_up.weight` and `.alpha`, with `prefixes` naming each component (unet -> lora_unet). The
    text encoders' modules are under `text_model`, as in the checkpoints kohya's scripts train on."""
    tensors, metadata = read_raw(peft_file)
    config = json.loads(metadata["lora_adapter_metadata"])
    out_tensors = {}
    for key, value in tensors.items():
        component, rest = key.split(".", 1)
        module, role = rest.rsplit(".", 2)[0], rest.rsplit(".", 2)[1]
        if component.startswith("text_encoder") and not module.startswith("text_model."):
            module = f"text_model.{module}"
        name = prefixes[component] + module.replace(".", "_")
        out_tensors[f"{name}.{'lora_down' if role == 'lora_A' else 'lora_up'}.weight"] = value
        out_tensors[f"{name}.alpha"] = np.array(config[f"{component}.lora_alpha"], np.float32)
    return write_raw(out, out_tensors)


def with_peft_naming(peft_file: Path, out: Path) -> Path:
    """The same adapter with PEFT's in-model names: `<module>.base_layer` segments and the adapter
    name (`lora_A.default.weight`), and its alpha as per-module tensors instead of metadata."""
    tensors, metadata = read_raw(peft_file)
    config = json.loads(metadata["lora_adapter_metadata"])
    renamed = {}
    for key, value in tensors.items():
        component = key.split(".", 1)[0]
        module, role = key.rsplit(".", 2)[0], key.rsplit(".", 2)[1]
        renamed[f"{module}.base_layer.{role}.default.weight"] = value
        renamed[f"{module}.alpha"] = np.array(config[f"{component}.lora_alpha"], np.float32)
    return write_raw(out, renamed)


# FLUX.1's original (Black Forest Labs) modules the Flux tests adapt, and the diffusers modules each
# fuses, in its row order: the tests' own table, against which runners/families/flux/lora_keys.py's is checked.
# Blocks, which diffusers' kohya conversion reads:
FLUX_ORIGINAL = {
    "double_blocks.0.img_attn.qkv": [f"transformer_blocks.0.attn.to_{x}" for x in "qkv"],
    "double_blocks.0.txt_mod.lin": ["transformer_blocks.0.norm1_context.linear"],
    "double_blocks.0.img_mlp.2": ["transformer_blocks.0.ff.net.2"],
    "single_blocks.1.linear2": ["single_transformer_blocks.1.proj_out"],
    "single_blocks.0.modulation.lin": ["single_transformer_blocks.0.norm.linear"],
}
# What diffusers 0.42's kohya conversion does not apply: a single block's linear1 (q, k, v and the MLP
# input), for which it fixes FLUX.1's widths (3072, 12288), and the top-level modules, which it names
# without the `transformer.` prefix, so that load_lora_weights drops them without a word. The tests
# give diffusers the same change in its own names instead (`to_diffusers_split`).
FLUX_ORIGINAL_UNREAD = {
    "single_blocks.0.linear1": [f"single_transformer_blocks.0.attn.to_{x}" for x in "qkv"]
    + ["single_transformer_blocks.0.proj_mlp"],
    "img_in": ["x_embedder"],
    "guidance_in.in_layer": ["time_text_embed.guidance_embedder.linear_1"],
    "final_layer.linear": ["proj_out"],
    "final_layer.adaLN_modulation.1": ["norm_out.linear"],  # FLUX.1 holds (shift, scale), diffusers (scale, shift)
}


def flux_original_adapter(folder: Path, modules: dict[str, list[str]], out: Path, seed: int, rank: int = 4,
                          alpha: float = 2.0, comfy: bool = False) -> Path:
    """A random adapter in kohya's Flux format (`lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight`)
    or ComfyUI's (`diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight`) for FLUX.1 `modules`
    of the tiny pipeline in `folder`, shaped from its transformer's weights."""
    from safetensors.numpy import load_file

    weights = {k: v for f in (Path(folder) / "transformer").glob("*.safetensors") for k, v in load_file(f).items()}
    rng = np.random.default_rng(seed)
    tensors = {}
    for original, targets in modules.items():
        rows = sum(weights[f"{t}.weight"].shape[0] for t in targets)
        name = f"diffusion_model.{original}" if comfy else "lora_unet_" + original.replace(".", "_")
        tensors[f"{name}.lora_down.weight"] = 0.3 * rng.standard_normal((rank, weights[f"{targets[0]}.weight"].shape[1]))
        tensors[f"{name}.lora_up.weight"] = 0.3 * rng.standard_normal((rows, rank))
        tensors[f"{name}.alpha"] = np.array(alpha)
    return write_raw(out, tensors)


def to_diffusers_split(original_file: Path, modules: dict[str, list[str]], folder: Path, out: Path) -> Path:
    """A kohya Flux adapter of `modules` as diffusers' PEFT keys: each diffusers module gets the whole
    down and its rows of up (what diffusers' conversion does), alpha folded into down, the final
    layer's modulation halves swapped."""
    from safetensors.numpy import load_file

    weights = {k: v for f in (Path(folder) / "transformer").glob("*.safetensors") for k, v in load_file(f).items()}
    tensors, _ = read_raw(original_file)
    split = {}
    for original, targets in modules.items():
        name = "lora_unet_" + original.replace(".", "_")
        down, up, alpha = (tensors[f"{name}.{r}"] for r in ("lora_down.weight", "lora_up.weight", "alpha"))
        if original.startswith("final_layer.adaLN"):
            shift, scale = np.split(up, 2)
            up = np.concatenate([scale, shift])
        rows = np.cumsum([weights[f"{t}.weight"].shape[0] for t in targets])[:-1]
        for target, part in zip(targets, np.split(up, rows)):
            split[f"transformer.{target}.lora_A.weight"] = down * float(alpha) / down.shape[0]
            split[f"transformer.{target}.lora_B.weight"] = part
    return write_raw(out, split)
