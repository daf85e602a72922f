"""Export without holding the weights: trace the submodule built on the meta device (shapes
only), then point every initializer of the graph at its bytes in the component's safetensors
files. Saving streams them from there into the graph's external data, one tensor at a time, so
a submodule's weights are never in memory twice, nor even once as a whole.

Buffers that a checkpoint does not hold (position ids...) are made as the module's own
constructor makes them; only the parameters are left empty.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": None, "I64": np.int64}


def empty_component(src, component: str, **load_kwargs):
    """The component as its class builds it from its config: parameters on the meta device,
    buffers real (they are small, and not always in the checkpoint)."""
    import importlib

    from accelerate import init_empty_weights

    library, class_name = src.model_index()[component]
    cls = getattr(importlib.import_module(library), class_name)
    folder = src.folder / component
    with init_empty_weights(include_buffers=False):
        if hasattr(cls, "load_config"):  # diffusers
            module = cls.from_config(cls.load_config(folder))
        else:  # transformers
            module = cls._from_config(cls.config_class.from_pretrained(folder), **load_kwargs)
    return module.eval()


def checkpoint_index(folder: Path) -> dict[str, dict]:
    """{tensor name: file, dtype, shape, offset, length} over the folder's safetensors files,
    read from their headers only."""
    index = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with open(path, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(size))
        for name, t in header.items():
            if name != "__metadata__":
                start, end = t["data_offsets"]
                index[name] = {"file": path, "dtype": t["dtype"], "shape": t["shape"], "offset": 8 + size + start,
                               "length": end - start}
    return index


def attach_weights(model, wrapper, index: dict[str, dict], buffers: dict) -> dict[str, int]:
    """Give the graph traced from `wrapper` (`model`, onnx-ir) its weights: each initializer named
    after a parameter of the wrapped component reads its checkpoint bytes in place (converted on
    demand when the dtypes differ); `buffers` ({name: tensor}, as the component built them) give
    theirs. Returns counts."""
    import onnx_ir as ir

    (prefix, component), = dict(wrapper.named_children()).items()
    aliases = {}  # tied parameters: every name of one tensor -> all its names
    for name, p in component.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    names = {name: group for group in aliases.values() for name in group}
    counts = {"mapped": 0, "converted": 0, "buffers": 0}
    for name, value in model.graph.initializers.items():
        key = name.removeprefix(prefix + ".")
        if key in buffers:
            value.const_value = ir.tensor(buffers[key].detach().numpy(), name=name)
            counts["buffers"] += 1
            continue
        found = next((alias for alias in names.get(key, [key]) if alias in index), None)
        if found is None:
            continue  # a constant the exporter made: it has its value already
        entry, want = index[found], value.const_value.dtype
        have = ir.DataType.from_numpy(np.dtype(_DTYPES[entry["dtype"]]))
        stored = ir.ExternalTensor(entry["file"].name, entry["offset"], entry["length"], have,
                                   shape=ir.Shape(entry["shape"]), name=name, base_dir=entry["file"].parent)
        if have == want:
            value.const_value = stored
            counts["mapped"] += 1
        else:
            value.const_value = ir.LazyTensor(lambda s=stored, w=want: ir.tensor(s.numpy().astype(w.numpy()), name=s.name),
                                              dtype=want, shape=stored.shape, name=name)
            counts["converted"] += 1
    return counts
