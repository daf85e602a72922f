"""A Triton request's tensors -> Pipeline calls, and their images back. The tensors are named as
the Pipeline's keyword arguments; a bad value is a ValueError naming its field, which the model
answers with Triton's INVALID_ARG (HTTP 400) while the server goes on. Pure numpy: the tests and
the model share it, and it needs no Triton."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from runners.conditioning.controlnet import controlnets
from runners.options import Option
from runners.pipeline import FAMILIES
from runners.serving import adapters


class Tensor(NamedTuple):
    """One input or output of the model's config.pbtxt: dims after Triton's batch dimension."""
    name: str
    data_type: str
    dims: tuple[int, ...] = (1,)
    optional: bool = True


# Triton's type of each option kind (runners/options.py) and the dims after the batch dimension.
TRITON_TYPES = {"text": "TYPE_STRING", "int": "TYPE_INT32", "float": "TYPE_FP32", "bool": "TYPE_BOOL",
                "image": "TYPE_UINT8", "mask": "TYPE_UINT8"}
_DIMS = {"image": (-1, -1, 3), "mask": (-1, -1)}
# What a server adds to the call's options: applied around a run, not arguments of the call.
SERVER_INPUTS = (
    # A step cache for this request, spelled as the CLI's --cache: "taylorseer:interval=3,before=6,after=-2".
    Tensor("cache", "TYPE_STRING"),
    # LoRA adapters of the server's --lora-dir for this request, as JSON: '[{"name": "style", "scale": 0.8}]'.
    Tensor("loras", "TYPE_STRING"),
)
# Per prompt: its images, (num_images_per_prompt, height, width, RGB); a video model's, its videos' frames
# (num_videos_per_prompt, frames, height, width, RGB) and, when the request asks for that output, each as mp4 bytes.
OUTPUT = Tensor("images", "TYPE_UINT8", (-1, -1, -1, 3), optional=False)
VIDEO_OUTPUTS = (Tensor("frames", "TYPE_UINT8", (-1, -1, -1, -1, 3), optional=False),
                 Tensor("mp4", "TYPE_STRING", (-1,), optional=False))
_BEFORE_THE_RUN = ("loras",)  # what the model applies to its Pipeline before a run: not an argument of the call


def served(pipeline, manifest: dict) -> list[Option]:
    """The declared options of `pipeline` (a family's class) a server takes in a request (not arrays): the
    image tasks' only where the artifact has a VAE encoder, the ControlNets' where it has ControlNets."""
    left_out = {group for group, present in (("image", "vae_encoder" in manifest["submodules"]),
                                             ("controlnet", bool(controlnets(manifest)))) if not present}
    return [o for o in pipeline.options if o.cli and o.kind in TRITON_TYPES and o.group not in left_out]


def inputs_for(manifest: dict) -> tuple[Tensor, ...]:
    """The Triton model's inputs for an artifact: its family's served options, then the server's own.
    Each batch row of a request is one prompt; an omitted optional input takes the family's default. A
    per-ControlNet option has one more dimension, first: its values in the order of the ControlNets (the
    control images of a row share one size)."""
    options = served(FAMILIES[manifest["model"]["family"]], manifest)
    return tuple(Tensor(o.name, "TYPE_INT64" if o.wide else TRITON_TYPES[o.kind],
                        ((-1,) if o.repeat else ()) + _DIMS.get(o.kind, () if o.repeat else (1,)),
                        optional=o.name != "prompt") for o in options) + SERVER_INPUTS


def outputs_for(manifest: dict) -> tuple[Tensor, ...]:
    """The Triton model's outputs for an artifact: its images, or a video model's frames and mp4 files."""
    return VIDEO_OUTPUTS if FAMILIES[manifest["model"]["family"]].layout.video else (OUTPUT,)


def _text(name: str, row: int, value) -> str:
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError as e:
        raise ValueError(f"{name}[{row}] is not UTF-8 text ({e.reason} at byte {e.start}): send UTF-8") from None


_SCALARS = {"text": _text, "int": lambda name, row, v: int(v), "float": lambda name, row, v: float(v),
            "bool": lambda name, row, v: bool(v)}


def _declared() -> dict[str, Option]:
    """{option name: its declaration} over every family's."""
    return {o.name: o for pipeline in FAMILIES.values() for o in pipeline.options}


def per_controlnet(option: Option, values: list):
    """A per-ControlNet option's values as the call takes them: the list, or one number alone (every ControlNet's,
    as in a Python call); images stay a list."""
    return values[0] if len(values) == 1 and option.kind not in _DIMS else values


def _value(option: Option | None, name: str, row: int, value):
    """One row's value of a field: an image, a scalar, or a per-ControlNet option's values."""
    kind = option.kind if option else "text"
    if option and option.repeat:
        return per_controlnet(option, [_one(kind, name, row, v) for v in value])
    return _one(kind, name, row, value)


def _one(kind: str, name: str, row: int, value):
    if kind in _DIMS:
        from PIL import Image

        return Image.fromarray(np.ascontiguousarray(value), "RGB" if kind == "image" else "L")
    return _SCALARS[kind](name, row, value.reshape(-1)[0])


def calls(tensors: dict[str, np.ndarray]) -> list[dict]:
    """The Pipeline keyword arguments of each batch row. `tensors` are one request's inputs by name
    (Triton has checked their dtypes and that they share the batch dimension); a row without a seed
    gets a random one here, so that a batched run can draw each row's latents from its seed."""
    if "prompt" not in tensors:
        raise ValueError("prompt is missing: every request needs a prompt (TYPE_STRING, one per batch row)")
    declared = _declared()
    rows = []
    for row in range(len(tensors["prompt"])):
        call = {}
        for name, array in tensors.items():
            if name == "loras":  # none named is no field: such a call batches with those that leave it out
                pairs = adapters.parse(_text(name, row, array[row].reshape(-1)[0]), row)
                call.update({name: pairs} if pairs else {})
            else:
                call[name] = _value(declared.get(name), name, row, array[row])
        if "seed" not in call:
            call["seed"] = int(np.random.default_rng().integers(2**63))
        rows.append(call)
    return rows


def batch_key(call: dict):
    """Calls with equal keys run as one Pipeline call (one denoiser batch): text to image with the same
    settings; their prompts, negative prompts and seeds may differ. None: the call runs alone (one with images
    or per-ControlNet values)."""
    declared = _declared()
    if any(name in declared and (declared[name].kind in _DIMS or declared[name].repeat) for name in call):
        return None
    return tuple(sorted((k, v) for k, v in call.items() if k not in ("prompt", "negative_prompt", "seed")))


def groups(all_calls: list[dict], max_images: int, batched: bool) -> list[list[int]]:
    """Indices of `all_calls` in runs: calls sharing a batch key, at most `max_images` images a run
    (the artifact's denoiser batch, halved for guidance), in arrival order; each alone if not `batched`."""
    runs: list[list[int]] = []
    open_runs: dict = {}
    for i, call in enumerate(all_calls):
        key = batch_key(call) if batched else None
        per_call = call.get("num_images_per_prompt", 1)
        run = open_runs.get(key) if key is not None else None
        if run is not None and (len(run) + 1) * per_call <= max_images:
            run.append(i)
            continue
        runs.append([i])
        if key is not None:
            open_runs[key] = runs[-1]
    return runs


def run(pipe, group: list[dict]) -> list[np.ndarray]:
    """Each call's images as uint8 (num_images_per_prompt, H, W, 3) (a video model's frames, (num_videos_per_prompt,
    F, H, W, 3)). One call runs as itself, so its
    image is exactly the Pipeline's for its seed; several (one batch key) run as one Pipeline call,
    each prompt's starting latents drawn from its own seed as it would be alone. The adapters a call
    names are the model's to apply before (`AdapterSets.activate`)."""
    group = [{k: v for k, v in call.items() if k not in _BEFORE_THE_RUN} for call in group]
    if pipe.layout.video:  # each call alone (the model batches no video requests): its frames, rounded as PIL's are
        return [(pipe(**call) * 255).round().astype(np.uint8) for call in group]
    if len(group) == 1:
        return [np.stack([np.asarray(image) for image in pipe(**group[0], output_type="pil")])]
    first = group[0]
    per_prompt = first.get("num_images_per_prompt", 1)
    size = pipe.constants["default_image_size"]
    shape = pipe.layout.shape(pipe, per_prompt, first.get("height", size), first.get("width", size))
    # each call's draw as the loop takes it, then as `latents=` takes it (FLUX.1's and Qwen-Image's packed)
    latents = pipe.layout.as_diffusers(np.concatenate([np.random.default_rng(c["seed"]).standard_normal(
        shape, dtype=np.float32) for c in group]))
    settings = {k: v for k, v in first.items() if k not in ("prompt", "negative_prompt", "seed")}
    images = pipe([c["prompt"] for c in group], negative_prompt=[c.get("negative_prompt", "") for c in group],
                  latents=latents, output_type="pil", **settings)
    pixels = np.stack([np.asarray(image) for image in images])
    return list(pixels.reshape(len(group), per_prompt, *pixels.shape[1:]))
