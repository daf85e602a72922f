"""Export without holding the weights: trace the submodule with weightless parameters, then point
each initializer of the graph at its bytes in the component's safetensors files.

The parameters are FakeTensors (shapes and dtypes, no storage) on the CPU device: tracing sees
exactly what it sees with real CPU weights, so the graph is the ordinary export's (the meta device
is not: there, SDPA decomposes differently). Buffers are built real by the module's constructor.
After tracing, `attach_weights` gives every parameter's initializer its checkpoint bytes in place
(`ir.ExternalTensor`), and `defer_weight_transposes` turns the exporter's Transpose of a weight
(every linear layer has one) into a tensor computed when it is written. Saving then streams the
weights from the checkpoint into the graph's external data one at a time: a submodule's weights
are never in memory as a whole, nor twice.
"""
from __future__ import annotations

import importlib
import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx_ir as ir

from export.random_weights import RECIPE, drawn_values
from runners.manifest import tensor_values
from runners.adapters.provenance import WeightTable, dtype_name

# FLUX.1 and SD3.5 ship BF16 checkpoints
_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I64": np.int64}


class WeightsError(RuntimeError):
    """A parameter of the traced graph has no usable tensor in the checkpoint."""


def weightless_component(src, component: str, dtype: str, **load_kwargs):
    """The component as from_pretrained would give it in `dtype`, with FakeTensor parameters.

    The module is built on the meta device from its config (accelerate's `init_empty_weights`),
    cast to `dtype` except the modules its class keeps in float32 (`_keep_in_fp32_modules`:
    T5's `wo`, which overflows fp16), then each parameter becomes a FakeTensor on the CPU."""
    import torch
    from accelerate import init_empty_weights
    from torch._subclasses.fake_tensor import FakeTensorMode

    library, class_name = src.model_index()[component]
    cls = getattr(importlib.import_module(library), class_name)
    folder = src.folder / component
    with init_empty_weights(include_buffers=False):
        if hasattr(cls, "load_config"):  # diffusers
            module = cls.from_config(cls.load_config(folder))
        else:  # transformers
            module = cls._from_config(cls.config_class.from_pretrained(folder), **load_kwargs)
    if hasattr(module, "tie_weights"):  # outside the context: ties the meta parameters
        module.tie_weights()
    module.to(getattr(torch, dtype))
    keep = getattr(module, "_keep_in_fp32_modules", None) or []
    for name, sub in module.named_modules():
        if any(part in keep for part in name.split(".")):
            sub.float()
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # real inputs and buffers meet fake weights
    fakes = {}  # one fake per parameter object: tied parameters stay tied
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                if id(p) not in fakes:
                    with mode:
                        fakes[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=False)
                sub._parameters[name] = fakes[id(p)]
    return module.eval()


def checkpoint_index(folder: Path) -> dict[str, dict]:
    """{tensor name: file, dtype, shape, offset, length} over the folder's safetensors files, read
    from their headers only. Files are named by their real paths: the hub's cache links a snapshot's
    files to its blobs, which onnx-ir would otherwise refuse to read as outside the folder. A random
    component's drawn weights (export/random_weights.py) are entries with `drawn`: the seed they are
    drawn with when read, and no file."""
    index = {}
    recipe = Path(folder) / RECIPE
    if recipe.exists():
        drawn = json.loads(recipe.read_text())
        size = np.dtype(_SAFETENSORS_DTYPES[drawn["dtype"]]).itemsize
        index = {name: {"drawn": drawn["seed"], "dtype": drawn["dtype"], "shape": shape,
                        "length": int(np.prod(shape)) * size} for name, shape in drawn["tensors"].items()}
    for path in sorted(p.resolve() for p in Path(folder).glob("*.safetensors")):
        with open(path, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(size))
        for name, t in header.items():
            if name != "__metadata__":
                start, end = t["data_offsets"]
                index[name] = {"file": path, "dtype": t["dtype"], "shape": t["shape"], "offset": 8 + size + start,
                               "length": end - start}
    return index


def link_checkpoint(folder: Path, out: Path) -> dict[str, str]:
    """Link the safetensors files of `folder` into `out` (by names ending in .safetensors: a hub cache's real
    files are blobs named by their hash); returns {tensor name: the linked file's name}."""
    files = {name: t["file"] for name, t in checkpoint_index(folder).items()}
    linked = {file: file.with_suffix(".safetensors").name for file in set(files.values())}
    for file, name in linked.items():
        (out / name).symlink_to(file)
    return {name: linked[file] for name, file in files.items()}


def copy_tensors(folder: Path, prefixes: tuple[str, ...], out_file: Path) -> list[str]:
    """Copy the tensors of `folder`'s checkpoint whose names start with one of `prefixes` into the safetensors
    file `out_file` (each checkpoint file opened once); returns their names. For a few modules: they are held
    in memory together."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    by_file = {}
    for name, t in checkpoint_index(folder).items():
        if name.startswith(prefixes):
            by_file.setdefault(t["file"], []).append(name)
    copied = {}
    for file, names in by_file.items():
        with safe_open(file, "pt") as f:
            copied.update({name: f.get_tensor(name) for name in names})
    save_file(copied, out_file)
    return list(copied)


def attach_weights(model: ir.Model, wrapper, index: dict[str, dict], component: str,
                   table: WeightTable, renamed: dict[str, str] | None = None) -> dict[str, int]:
    """Give the graph traced from `wrapper` its weights: each initializer named after a parameter
    of the wrapped component reads its checkpoint bytes in place, converted when it is written if
    the dtypes differ (T5's float32 `wo` from an fp16 checkpoint), and `table` records which
    checkpoint tensor of `component` it holds. A buffer the checkpoint holds (SD3's position
    embedding) is read from it too, as from_pretrained does; the others keep the value the
    constructor gave them. `renamed`: the checkpoint keys of the names transformers renames as it loads
    (`loaded_names`). Returns counts."""
    params = {}  # every name of a parameter (tied ones have several) -> the names of that tensor
    for name, p in wrapper.named_parameters(remove_duplicate=False):
        params.setdefault(id(p), []).append(name)
    aliases = {name: group for group in params.values() for name in group}
    buffers = {name for name, _ in wrapper.named_buffers()}
    counts = {"weights_mapped": 0, "weights_converted": 0, "buffers_from_checkpoint": 0}
    read = set()
    for name, value in model.graph.initializers.items():
        if name in aliases:
            key, stored = _stored(name, aliases[name], index, renamed)
            read.add(key)
            table.source(name, component, key, dtype_name(value.const_value.dtype), stored.shape)
        elif name in buffers and _key(name) in index:
            _, stored = _stored(name, [name], index)
            counts["buffers_from_checkpoint"] += 1
        else:
            continue  # a buffer the checkpoint lacks, or a constant of the exporter: it has its value
        want = value.const_value.dtype
        if stored.dtype == want:
            value.const_value = stored
            counts["weights_mapped"] += 1
        else:
            value.const_value = ir.LazyTensor(
                lambda s=stored, w=want: ir.tensor(tensor_values(s).astype(w.numpy())), dtype=want, shape=stored.shape,
                name=name)
            counts["weights_converted"] += 1
    table.unread = {(component, key) for key in index if key not in read and key.endswith(".weight")}
    return counts


def loaded_names(component, index: dict[str, dict]) -> dict[str, str]:
    """{the name from_pretrained gives a tensor of `component`: its checkpoint key}, where they differ: transformers
    renames a checkpoint's keys as it loads them (a Mistral3 checkpoint's `language_model.model.*` is the module's
    `model.language_model.*`), with the renamings it registers for the model's classes."""
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, apply_renamings

    if not isinstance(component, PreTrainedModel):
        return {}
    renamings = [t for t in get_model_conversion_mapping(component) if isinstance(t, WeightRenaming)]
    loaded = {apply_renamings(key, renamings): key for key in index} if renamings else {}
    return {name: key for name, key in loaded.items() if name != key}


def _key(name: str) -> str:
    # The wrapper adds one prefix (`t5.`, `vae.`): the checkpoint names the component's own tensors. A name
    # without one is the wrapper's own buffer (Z-Image's rotary tables), which no checkpoint holds.
    return name.split(".", 1)[-1]


def _stored(name: str, aliases: list[str], index: dict[str, dict],
            renamed: dict[str, str] | None = None) -> tuple[str, ir.ExternalTensor | ir.LazyTensor]:
    keys = [_key(alias) for alias in aliases]
    key = next((k for k in keys if k in index), None) or next((renamed[k] for k in keys if k in (renamed or {})), None)
    if key is None:
        raise WeightsError(f"parameter {name} is not in the checkpoint (looked for {', '.join(keys)})")
    entry = index[key]
    if entry["dtype"] not in _SAFETENSORS_DTYPES:
        raise WeightsError(f"{key}: checkpoint dtype {entry['dtype']} is not one of {', '.join(_SAFETENSORS_DTYPES)}")
    dtype = ir.DataType.from_numpy(np.dtype(_SAFETENSORS_DTYPES[entry["dtype"]]))
    if "drawn" in entry:
        return key, ir.LazyTensor(lambda: ir.tensor(drawn_values(key, tuple(entry["shape"]), entry["drawn"],
                                                                 dtype.numpy())),
                                  dtype=dtype, shape=ir.Shape(entry["shape"]), name=name)
    # By absolute path, with no folder for onnx-ir to guard: given one, it refuses a file of several hard links (a
    # model manager's shared folders, `cp -al` copies), its defence against a link planted in an untrusted model's
    # folder. The path is the checkpoint's own, from its index (symlinks resolved), not one a graph file names.
    return key, ir.ExternalTensor(str(entry["file"]), entry["offset"], entry["length"], dtype,
                                  shape=ir.Shape(entry["shape"]), name=name)


def defer_weight_transposes(model: ir.Model, table: WeightTable) -> int:
    """Replace each Transpose of a weight by an initializer computed when the graph is written
    (recorded in `table` as the weight transposed).

    The exporter's optimizer folds these (a linear layer's weight is stored transposed for MatMul)
    by computing them all in memory: the whole submodule's weights again. Done here first, each is
    computed, written and dropped in turn; the graph is the same. Returns how many were deferred."""
    deferred = 0
    for node in list(model.graph):
        source = node.inputs[0] if node.op_type == "Transpose" and node.inputs else None
        if source is None or not source.is_initializer() or source.const_value is None:
            continue
        perm = node.attributes["perm"].as_ints() if "perm" in node.attributes else None
        weight, out = source.const_value, node.outputs[0]
        shape = ir.Shape([weight.shape[i] for i in perm] if perm else list(reversed(weight.shape)))
        folded = ir.Value(name=out.name, shape=shape, type=ir.TensorType(weight.dtype))
        folded.const_value = ir.LazyTensor(
            lambda w=weight, p=perm: ir.tensor(np.ascontiguousarray(np.transpose(tensor_values(w), p))),
            dtype=weight.dtype, shape=shape, name=out.name)
        out.replace_all_uses_with(folded)
        model.graph.remove(node, safe=True)
        model.graph.register_initializer(folded)
        if source.name in table:
            table.transposed(source.name, out.name, perm or list(reversed(range(len(shape)))), shape)
        if not source.uses() and not source.is_graph_output():
            model.graph.initializers.pop(source.name)
        deferred += 1
    return deferred
