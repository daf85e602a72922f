"""Random-weight components written tensor by tensor, for models too large to hold in memory
(sd3-fullsize: 7.5 B parameters, 15 GB in fp16).

The module is built with its parameters on the meta device (shapes only) and its buffers real
(small; a checkpoint holds the persistent ones: SD3's sin-cos position embedding), its config
saved where from_pretrained reads it, and each weight drawn from a generator seeded by its name
and streamed into one safetensors file in the storage dtype, in blocks: building never holds
more than one block.

A component can instead keep only the recipe of its weights (`drawn`: RECIPE, the seed, the storage
dtype and every tensor's shape) and its buffers: the export draws each weight as it writes it
(export/lazy_weights.py), so a model whose folder and export would not fit on the disk side by side
(qwen-image-fullsize: 41 GB each in fp16) never has its weights on disk twice. Such a folder is the
export's input only: from_pretrained cannot load it.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np

BLOCK_ELEMENTS = 1 << 24  # generated and written 16 M values at a time
_SAFETENSORS_DTYPES = {"float16": "F16", "float32": "F32"}
RECIPE = "random_weights.json"  # a drawn component's weights: {"seed", "dtype", "tensors": {name: shape}}
DRAWN_BUFFERS = "random_weights_buffers.safetensors"  # its persistent buffers, as the constructor made them
# Weights are normal with std INIT_GAIN / sqrt(fan-in): each layer keeps its activations near unit
# scale whatever its width, and attention logits stay O(1) even without a 1/sqrt(d) scale (T5).
# A width-independent std (0.02) makes T5-XXL's unscaled logits so large that fp16 rounding picks
# different attention winners than fp32, and fp16 outputs stop agreeing with fp32 ones.
INIT_GAIN = 0.5


def _tensors(module) -> dict[str, tuple[int, ...]]:
    """What a checkpoint of `module` holds: each parameter once (tied ones under their first
    name, which from_pretrained re-ties) and the persistent buffers."""
    params = {name: tuple(p.shape) for name, p in module.named_parameters()}
    buffers = {name: tuple(b.shape) for name, b in module.named_buffers()}
    return {name: params.get(name, buffers.get(name)) for name in module.state_dict()
            if name in params or name in buffers}


def _values(name: str, shape: tuple[int, ...], seed: int, dtype: str):
    """Blocks of the tensor's values: zeros for biases, ones for 1-D norm scales, else normal
    with std INIT_GAIN / sqrt(fan-in); the same name and seed give the same values."""
    count = math.prod(shape)
    if name.endswith("bias"):
        fill = 0.0
    elif len(shape) == 1 and "norm" in name:
        fill = 1.0
    else:
        fill = None
    std = INIT_GAIN / math.sqrt(math.prod(shape[1:]) or shape[0])  # [out, in, (kernel)]: fan-in; 1-D: its size
    key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    rng = np.random.default_rng(key)
    for start in range(0, count, BLOCK_ELEMENTS):
        n = min(BLOCK_ELEMENTS, count - start)
        block = np.full(n, fill, np.float32) if fill is not None else rng.standard_normal(n, np.float32) * std
        yield block.astype(dtype)


def drawn_values(name: str, shape: tuple[int, ...], seed: int, dtype: str) -> np.ndarray:
    """The whole tensor `write_component` writes for `name` (a drawn component's weight, made when it is read)."""
    return np.concatenate(list(_values(name, shape, seed, dtype))).reshape(shape)


def write_config(module, folder: Path) -> Path:
    """The component's config where from_pretrained reads it; returns where its weights go."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if hasattr(module, "save_config"):  # diffusers
        module.save_config(folder)
        return folder / "diffusion_pytorch_model.safetensors"
    module.config.save_pretrained(folder)  # transformers
    return folder / "model.safetensors"


def write_component(module, folder: Path, dtype: str = "float16", seed: int = 0, drawn: bool = False) -> int:
    """Write `module` (parameters on the meta device) as a from_pretrained folder with random weights;
    returns the bytes written. `drawn`: the recipe of the weights instead, and the buffers."""
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"storage dtype {dtype!r}: use float16 or float32")
    path = write_config(module, folder)
    tensors = _tensors(module)
    buffers = dict(module.named_buffers())
    if drawn:
        recipe = {"seed": seed, "dtype": _SAFETENSORS_DTYPES[dtype],
                  "tensors": {name: list(shape) for name, shape in tensors.items() if name not in buffers}}
        (path.parent / RECIPE).write_text(json.dumps(recipe) + "\n")
        path = path.parent / DRAWN_BUFFERS
        tensors = {name: shape for name, shape in tensors.items() if name in buffers}
        if not tensors:
            return 0
    itemsize = np.dtype(dtype).itemsize
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors.items():
        size = math.prod(shape) * itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)  # the format aligns the data to 8 bytes
    with open(path, "wb") as f:  # inside the model's temporary folder (export.source): complete or absent
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name, shape in tensors.items():
            buffer = buffers.get(name)  # the constructor's own values (SD3's sin-cos position embedding)
            blocks = [buffer.detach().float().numpy().astype(dtype)] if buffer is not None else _values(name, shape, seed, dtype)
            for block in blocks:
                f.write(block.tobytes())
    return offset


def build_modules(builders: dict, seed: int, streamed: bool) -> dict:
    """{component: module}, built in order: with real weights under seed + its position, or
    (`streamed`) with parameters on the meta device, for `save_pipeline` to stream."""
    import torch

    def seeded(offset: int, build):
        torch.manual_seed(seed + offset)
        return build().eval()

    if not streamed:
        return {name: seeded(i, build) for i, (name, build) in enumerate(builders.items())}
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):  # buffers are small: real, as the constructor makes them
        modules = {name: build().eval() for name, build in builders.items()}
    for module in modules.values():  # tied once the context is left (T5's embedding is its `shared`)
        if hasattr(module, "tie_weights"):
            module.tie_weights()
    return modules


def save_pipeline(pipeline_class: str, modules: dict, others: dict, out_dir: Path, dtype: str | None = None,
                  seed: int = 0, weights_for: list[str] | None = None, drawn: bool = False) -> None:
    """A diffusers pipeline folder: `modules` (torch modules) and `others` (scheduler, tokenizers,
    flags). With `dtype`, the modules come from `build_modules(streamed=True)` and are written
    tensor by tensor in that dtype; model_index.json is then written as save_pretrained would.
    `weights_for` (streamed only) names the components given weights: the others are written as
    configs alone (their shapes) and are absent from the pipeline. `drawn` (streamed only): the components
    given weights keep their recipe, drawn by the export (`write_component`)."""
    import diffusers

    if dtype is None:
        getattr(diffusers, pipeline_class)(**modules, **others).save_pretrained(out_dir, safe_serialization=True)
        return
    out_dir = Path(out_dir)
    index = {"_class_name": pipeline_class, "_diffusers_version": diffusers.__version__}
    for i, (name, module) in enumerate(modules.items()):
        if weights_for is not None and name not in weights_for:
            write_config(module, out_dir / name)
            index[name] = [None, None]
            continue
        write_component(module, out_dir / name, dtype, seed + i, drawn)
        index[name] = [type(module).__module__.split(".")[0], type(module).__name__]
    for name, value in others.items():
        if hasattr(value, "save_pretrained"):
            value.save_pretrained(out_dir / name)
            index[name] = [type(value).__module__.split(".")[0], type(value).__name__]
        else:
            index[name] = value
    (out_dir / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def redraw(layers, seed: int) -> None:
    """Seeded random weights (normal, over the square root of the fan-in) and biases (normal, 0.1) for
    layers a model starts at zero: a new ControlNet's output layers, which would change nothing, so that
    a test could not tell whether it ran."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in layers:
            fan_in = layer.weight[0].numel()
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator) / fan_in ** 0.5)
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=generator) * 0.1)
