"""The parity check without a submodule's weights in memory whole: PyTorch and ONNX Runtime each run the
whole submodule with one part of its weights in memory at a time. For submodules too large to hold
twice (FLUX.1's 12 B transformer: 24 GB in fp16), and for the reference of every fp16 export, computed in
fp32 over its fp16 weights (whole, that would double them).

- **The reference** is the weightless component (`export/lazy_weights.py`: FakeTensor parameters)
  whose modules are given their checkpoint tensors just before their forward runs and lose them
  after: one layer's weights at a time.
- **ONNX Runtime** runs the graph as consecutive segments of its topologically sorted nodes, each
  holding at most `segment_bytes` of weights. A segment is a model of its own whose initializers
  point at the same external data; the values that cross segments (activations at the probe
  shapes: megabytes) are kept between them.

Both compute exactly what the whole submodule computes: the outputs are compared as
`check_parity` compares a submodule's that fits."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from export.lazy_weights import _stored, checkpoint_index, loaded_names, weightless_component
from runners.manifest import tensor_values

SEGMENT_BYTES = 1 << 30  # weights per ONNX Runtime segment


def streamed_reference(spec, src, dtype: str, feeds: list[list[np.ndarray]]) -> list[list[np.ndarray]]:
    """The outputs of `spec`'s wrapper of the component for each of `feeds`, computed in fp32 over its
    weights as an export in `dtype` holds them (an fp16 export's rounded to fp16, except those it
    keeps in fp32), each module's read from the checkpoint as the module runs. A module with children
    whose own parameters its children's callers read without calling it (Z-Image's pad tokens, which
    the wrapper reads off the transformer) has them read for the whole call: such parameters are small."""
    import torch

    from export.onnx_export import wrapped

    held_as = {name: p.dtype for name, p in wrapped(
        spec, weightless_component(src, spec.component, dtype, **spec.load_kwargs), dtype).named_parameters(
        remove_duplicate=False)}
    component = weightless_component(src, spec.component, "float32", **spec.load_kwargs)
    module = wrapped(spec, component)
    index = checkpoint_index(src.folder / spec.component)
    renamed = loaded_names(component, index)  # keys transformers renames as it loads (Qwen2.5-VL's `model.*`)
    aliases = {}  # tied parameters: every name of one tensor, to find it in the checkpoint under any
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)

    def holder(path: str, sub, during):
        names = {p: f"{path}.{p}" if path else p for p, v in sub._parameters.items() if v is not None}
        fakes = {p: sub._parameters[p] for p in names}

        def load(*_):
            for p, full in names.items():
                _, stored = _stored(full, aliases[id(fakes[p])], index, renamed)
                values = torch.from_numpy(tensor_values(stored).astype(np.float32)).to(held_as[full]).float()
                sub._parameters[p] = torch.nn.Parameter(values, requires_grad=False)

        def drop(*_):
            sub._parameters.update(fakes)

        return during.register_forward_pre_hook(load), during.register_forward_hook(drop)

    hooks = [h for path, sub in module.named_modules() if any(v is not None for v in sub._parameters.values())
             for h in holder(path, sub, module if sub._modules else sub)]
    try:
        with torch.no_grad():
            return [[r.numpy() for r in module(*[torch.from_numpy(a) for a in inputs])] for inputs in feeds]
    finally:
        for h in hooks:
            h.remove()


def _names_used(node) -> set[str]:
    """The values a node reads, those of its subgraphs (If, Loop) from the enclosing graph included."""
    import onnx

    used = set(node.input)
    for attr in node.attribute:
        for graph in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
            inner = {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
            used |= {name for n in graph.node for name in _names_used(n) if name not in inner}
    return used - {""}


def _weight_bytes(init) -> int:
    import onnx

    itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type)).itemsize
    return int(np.prod(init.dims, dtype=np.int64)) * itemsize


def segments(model, segment_bytes: int) -> list[list]:
    """The graph's nodes in order, cut where the next node's weights would take a segment's past
    `segment_bytes` (a node whose weights alone exceed it is a segment of its own)."""
    sizes = {init.name: _weight_bytes(init) for init in model.graph.initializer}
    cut, current, held = [], [], set()
    for node in model.graph.node:
        new = {n for n in _names_used(node) if n in sizes} - held
        if current and sum(sizes[n] for n in held | new) > segment_bytes:
            cut.append(current)
            current, held = [], set()
            new = {n for n in _names_used(node) if n in sizes}
        current.append(node)
        held |= new
    return cut + [current] if current else cut


def segmented_outputs(onnx_path: Path, feeds: list[dict[str, np.ndarray]], session_options,
                      segment_bytes: int = SEGMENT_BYTES) -> list[list[np.ndarray]]:
    """The graph's outputs for each of `feeds`, run one segment (one ONNX Runtime session) at a time.
    Each segment's model is written beside the graph for as long as its session opens, so that its
    initializers' external data resolve as the graph's do."""
    import onnx
    import onnxruntime as ort

    onnx_path = Path(onnx_path)
    model = onnx.load(str(onnx_path), load_external_data=False)
    graph = model.graph
    types = {v.name: v.type for v in list(graph.value_info) + list(graph.output) + list(graph.input)}
    parts = segments(model, segment_bytes)
    initializers = {init.name: init for init in graph.initializer}
    produced_in = {o: k for k, part in enumerate(parts) for node in part for o in node.output}
    needed_after = {name: k for k, part in enumerate(parts) for node in part for name in _names_used(node)}
    finals = [o.name for o in graph.output]
    values = [dict(feed) for feed in feeds]
    for k, part in enumerate(parts):
        used = sorted({n for node in part for n in _names_used(node)})
        inputs = [n for n in used if n not in initializers and produced_in.get(n) != k]
        outputs = [o for node in part for o in node.output
                   if o and (needed_after.get(o, -1) > k or o in finals)]
        # (a value used by several later segments is kept: needed_after holds the last user)
        sub = onnx.helper.make_graph(
            part, f"{graph.name}_segment{k}",
            [onnx.helper.make_value_info(n, types[n]) if n in types else
             onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(values[0][n].dtype), None)
             for n in inputs],
            [onnx.helper.make_value_info(n, types[n]) if n in types else onnx.ValueInfoProto(name=n) for n in outputs],
            [initializers[n] for n in used if n in initializers])
        segment = onnx.helper.make_model(sub, opset_imports=model.opset_import, ir_version=model.ir_version,
                                         functions=model.functions)
        path = onnx_path.with_name(f".{onnx_path.stem}.segment{k}.onnx")
        try:
            onnx.save(segment, str(path))
            session = ort.InferenceSession(str(path), session_options, providers=["CPUExecutionProvider"])
        finally:
            path.unlink(missing_ok=True)
        for held in values:
            held.update(zip(outputs, session.run(outputs, {n: held[n] for n in inputs})))
            for name in inputs:  # freed once no later segment reads it
                if needed_after.get(name, -1) <= k and name not in finals:
                    held.pop(name, None)
        del session
    return [[held[name] for name in finals] for held in values]
