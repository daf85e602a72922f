"""An exported graph at concrete dims: the bytes of every tensor and the FLOPs of every node.

ONNX Runtime's symbolic shape inference resolves every shape at the given dims. Weights cross
over as shapes only, so analysing a 1.5 GB graph costs kilobytes. FLOPs are 2 per multiply-add
of MatMul, Gemm, Conv and the two matmuls inside fused attention (our exports' attention is
MatMuls, so it is counted, unlike torch's FlopCounterMode with the CPU SDPA kernel).
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import onnx

__all__ = ["Node", "OpGraph", "graph_flops", "graph_flops_by_op", "load_graph"]


@dataclasses.dataclass(frozen=True)
class Node:
    name: str
    op_type: str
    domain: str
    inputs: tuple[str, ...]  # "" where an optional input is omitted
    outputs: tuple[str, ...]


@dataclasses.dataclass
class OpGraph:
    """The nodes in file order and what the planner and the inspect table need about them."""

    nodes: list[Node]
    nbytes: dict[str, int]  # every activation (graph inputs included): its bytes at the dims
    flops: list[int]  # per node, 2 x multiply-adds (0 for ops that do none)
    workspace: list[int]  # per node, bytes the kernel allocates for itself while it runs
    weights: dict[str, int]  # initializer -> bytes
    parameters: int  # weight elements
    inputs: list[str]
    outputs: list[str]
    unknown: list[str]  # outputs shape inference left open (sized as the node's first input; inspect counts them)
    itemsize: dict[str, int] = dataclasses.field(default_factory=dict, repr=False)

    def elements(self, tensor: str) -> int:
        return self.nbytes.get(tensor, 0) // self.itemsize.get(tensor, 4)

    def work(self, i: int) -> int:
        """What recomputing node i costs: its FLOPs, or one per output element for ops that do
        no multiply-adds (elementwise, Resize, normalizations)."""
        return max(self.flops[i], sum(self.elements(t) for t in self.nodes[i].outputs))


_WEIGHT_ELEMENTS = 4096  # initializers this large cross as shapes; smaller ones (shapes, axes) as values


def _weights_as_inputs(model: onnx.ModelProto, min_elements: int = _WEIGHT_ELEMENTS) -> None:
    """Shape inference needs the weights' shapes, not their values: turn large initializers into
    graph inputs of the same type and shape."""
    graph = model.graph
    large = [i for i in graph.initializer if math.prod(i.dims) >= min_elements]
    for init in large:
        graph.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
        graph.initializer.remove(init)


# Ops ONNX Runtime's shape inference does not know, and a known op with the same output shape.
_SHAPE_STAND_INS = {"QuickGelu": "Identity"}


def _infer(model: onnx.ModelProto, dims: dict[str, int]) -> onnx.ModelProto:
    from engines.passes.ort_tools import infer_symbolic_shapes

    for node in model.graph.node:
        if node.op_type in _SHAPE_STAND_INS:
            node.op_type, node.domain = _SHAPE_STAND_INS[node.op_type], ""
            del node.attribute[:]
    weights = {i.name: i for i in model.graph.initializer}
    _weights_as_inputs(model)
    for value in model.graph.input:
        if value.name in weights:
            continue
        for d in value.type.tensor_type.shape.dim:
            if d.dim_param in dims:
                d.dim_value = dims[d.dim_param]
    del model.graph.value_info[:]
    return infer_symbolic_shapes(model, auto_merge=True)


def _mac_flops(node: onnx.NodeProto, shape) -> int:
    out = shape(node.output[0])
    if out is None:
        return 0
    if node.op_type == "MatMul":
        return 2 * math.prod(out) * shape(node.input[0])[-1]
    if node.op_type == "Gemm":
        transposed = any(a.name == "transA" and a.i for a in node.attribute)
        a = shape(node.input[0])
        return 2 * math.prod(out) * (a[0] if transposed else a[1])
    if node.op_type == "Conv":  # weight (Cout, Cin/groups, kh, kw)
        return 2 * math.prod(out) * math.prod(shape(node.input[1])[1:])
    if node.op_type == "MultiHeadAttention":  # Q.Kt and P.V over out (B, S, hidden), key length L
        key = shape(node.input[1])
        return 4 * math.prod(out) * (key[1] if len(key) == 3 else key[2])
    return 0


def _workspace(node: onnx.NodeProto, shape) -> int:
    """Bytes ONNX Runtime 1.31's CPU MultiHeadAttention allocates for itself (measured in
    tests/test_memory.py). Without a bias or mask it runs flash attention: its only buffers are
    Q, K and V transposed to (B, heads, S, head size). With one it also holds the (B, heads, S, L)
    probabilities: 1 GiB for SD1.5's first self-attention at 512x512, batch 2."""
    if node.op_type != "MultiHeadAttention":
        return 0
    query, key, value = (shape(name) for name in node.input[:3])
    if query is None or key is None or value is None:
        return 0
    copies = 4 * (math.prod(query) + math.prod(key) + math.prod(value))
    if not any(node.input[3:6]):  # bias, key_padding_mask, attention_bias
        return copies
    heads = next(a.i for a in node.attribute if a.name == "num_heads")
    length = key[1] if len(key) == 3 else key[2]
    return copies + query[0] * heads * query[-2 if len(query) == 3 else 2] * length * 4


def load_graph(source: onnx.ModelProto | Path | str, dims: dict[str, int]) -> OpGraph:
    """The graph at `dims` ({dim name: value} for the inputs' symbolic dims). A proto is changed
    in place (its large weights become inputs): pass a copy you still need."""
    if not isinstance(source, onnx.ModelProto):  # weights as shapes; the small ones a >2 GB file keeps outside as data
        from runners.manifest import load_onnx

        return graph_of(load_onnx(source), dims)
    model = source
    weights = {i.name: (list(i.dims), onnx.helper.tensor_dtype_to_np_dtype(i.data_type).itemsize)
               for i in model.graph.initializer}
    inputs = [i.name for i in model.graph.input]
    protos = list(model.graph.node)
    nodes = [Node(n.name or f"{n.op_type}_{i}", n.op_type, n.domain, tuple(n.input), tuple(n.output))
             for i, n in enumerate(protos)]
    model = _infer(model, dims)
    shapes, itemsize = {}, {}
    for v in [*model.graph.value_info, *model.graph.input, *model.graph.output]:
        t = v.type.tensor_type
        dims_ = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        shapes[v.name] = None if not t.HasField("shape") or None in dims_ else dims_
        itemsize[v.name] = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).itemsize if t.elem_type else 4
    for name, (shape, size) in weights.items():
        shapes[name], itemsize[name] = shape, size

    flops = [_mac_flops(n, shapes.get) for n in protos]
    workspace = [_workspace(n, shapes.get) for n in protos]
    nbytes, unknown = {}, []
    for name in inputs:
        if name not in weights:
            nbytes[name] = math.prod(shapes[name]) * itemsize[name]
    for node in nodes:
        for out in node.outputs:
            shape = shapes.get(out)
            if shape is None:  # an op the inference does not know: elementwise ops keep their input's size
                unknown.append(out)
                first = next((t for t in node.inputs if t and t not in weights), None)
                nbytes[out] = nbytes.get(first, 0)
                itemsize[out] = itemsize.get(first, 4)
            else:
                nbytes[out] = math.prod(shape) * itemsize[out]
    return OpGraph(nodes, nbytes, flops, workspace, {n: math.prod(d) * s for n, (d, s) in weights.items()},
                   sum(math.prod(d) for d, _ in weights.values()), [i for i in inputs if i not in weights],
                   [o.name for o in model.graph.output], unknown, itemsize)


def graph_flops_by_op(onnx_path: Path, dims: dict[str, int]) -> dict[str, int]:
    """Multiply-add FLOPs of one call of the graph with the given dynamic dims, by op type."""
    graph = load_graph(onnx_path, dims)
    per_op: dict[str, int] = {}
    for node, f in zip(graph.nodes, graph.flops):
        if f:
            per_op[node.op_type] = per_op.get(node.op_type, 0) + f
    return per_op


def graph_flops(onnx_path: Path, dims: dict[str, int]) -> int:
    """Multiply-add FLOPs of one call of the graph with the given dynamic dims."""
    return sum(graph_flops_by_op(onnx_path, dims).values())


def graph_of(model, dims: dict[str, int]) -> OpGraph:
    """`load_graph` for an onnx-ir model, without reading its weights: node i of the result is
    the model's node i."""
    from engines.passes.base import to_proto_without

    held = {name: v.const_value for name, v in model.graph.initializers.items()
            if v.const_value is not None and v.const_value.size >= _WEIGHT_ELEMENTS}
    return load_graph(to_proto_without(model, held), dims)
