"""QKV fusion: projections that read the same tensor become one MatMul, one bias Add and a Split.

A group is every MatMul (or Gemm) that reads the same activation with a constant 2-D weight
of the same input width and dtype: q/k/v of an attention, the two gate projections of T5's
gated FFN, the adaLN projections of an MMDiT that all read silu(temb). One GEMM over the
concatenated weights reads the activation once and runs at a larger, more efficient N.

The split happens right after the projection, so whatever follows each member (per-head
RMS norm of q and k, a second attention in the same block) sees exactly the tensor it saw.

A fused weight stays under `MAX_FUSED_BYTES`: a group past it becomes consecutive groups. Every
adaLN projection of FLUX.1's 57 blocks reads silu(temb): fused whole, they made one 6.5 GB fp16
weight, which the concatenation (and OpenVINO's int8 weights, in float32) held in memory at once
(BENCHMARKS.md's flux-fullsize scale check). Those projections are matrix-vector products at any
image size, as fast in pieces; q/k/v, gates and MLP inputs of real models stay far under the cap.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from engines.passes.base import GraphPass, Report
from engines.passes.rewrite import replace_uses
from runners.manifest import tensor_values
from runners.adapters.provenance import WeightTable, dtype_name

MAX_FUSED_BYTES = 512 * 2**20


@dataclass
class _Member:
    node: ir.Node  # the MatMul or Gemm
    weight: ir.Value  # (K, N) for MatMul, (N, K) for Gemm with transB=1
    bias: ir.Value | None  # 1-D constant of length N, from a following Add or Gemm's C
    bias_add: ir.Node | None  # the Add that applied it, removed with the node
    width: int  # N
    trans_b: int = 0  # Gemm's transB: the weight is (N, K)

    @property
    def output(self) -> ir.Value:
        return (self.bias_add or self.node).outputs[0]


def _const(value: ir.Value | None) -> ir.TensorProtocol | None:
    return None if value is None or not value.is_initializer() else value.const_value


def _bias_add(out: ir.Value, width: int) -> tuple[ir.Value, ir.Node] | tuple[None, None]:
    """The Add that adds a constant (width,) bias to `out`, if that is its only use."""
    uses = out.uses()
    if len(uses) != 1 or out.is_graph_output():
        return None, None
    add = uses[0].node
    if add.op_type != "Add" or add.domain != "":
        return None, None
    other = add.inputs[1 - uses[0].idx]
    c = _const(other)
    if c is None or tuple(c.shape) != (width,):
        return None, None
    return other, add


def _member(node: ir.Node, x: ir.Value) -> _Member | None:
    if node.domain != "" or node.inputs[0] is not x or len(node.inputs) < 2:
        return None
    w = _const(node.inputs[1])
    if w is None or len(w.shape) != 2:
        return None
    if node.op_type == "MatMul":
        width = w.shape[1]
        bias, add = _bias_add(node.outputs[0], width)
        return _Member(node, node.inputs[1], bias, add, width)
    if node.op_type == "Gemm":
        attrs = {k: a.value for k, a in node.attributes.items()}
        if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
            return None
        trans_b = attrs.get("transB", 0)
        width = w.shape[0] if trans_b else w.shape[1]
        c = node.inputs[2] if len(node.inputs) > 2 else None
        if c is not None and (_const(c) is None or tuple(_const(c).shape) != (width,)):
            return None
        return _Member(node, node.inputs[1], c, None, width, trans_b)
    return None


def _key(m: _Member) -> tuple:
    """Members fuse when they are the same op with the same input width, layout and dtype."""
    w = m.weight.const_value
    return m.node.op_type, m.trans_b, w.shape[1] if m.trans_b else w.shape[0], w.dtype


def find_groups(graph: ir.Graph) -> list[list[_Member]]:
    """Every group of two or more fusable projections of one tensor, in graph order."""
    groups = []
    seen: set[int] = set()
    for node in graph:
        for x in node.inputs[:1]:
            if x is None or id(x) in seen:
                continue
            seen.add(id(x))
            by_key = defaultdict(list)
            for use in x.uses():
                m = _member(use.node, x) if use.idx == 0 else None
                if m is not None:
                    by_key[_key(m)].append(m)
            groups.extend(g for members in by_key.values() for g in _capped(members) if len(g) > 1)
    return groups


def _capped(members: list[_Member]) -> list[list[_Member]]:
    """`members` in consecutive runs whose weights total at most `MAX_FUSED_BYTES` (a member
    larger than that alone)."""
    runs, size = [[]], 0
    for m in members:
        nbytes = m.weight.const_value.nbytes
        if runs[-1] and size + nbytes > MAX_FUSED_BYTES:
            runs.append([])
            size = 0
        runs[-1].append(m)
        size += nbytes
    return runs


def _lazy_concat(tensors: list, axis: int, name: str) -> ir.LazyTensor:
    """The concatenation, computed when the model is saved: no fused copy is held in memory."""
    shape = list(tensors[0].shape)
    shape[axis] = sum(t.shape[axis] for t in tensors)
    return ir.LazyTensor(lambda: ir.tensor(np.concatenate([tensor_values(t) for t in tensors], axis=axis)),
                         dtype=tensors[0].dtype, shape=ir.Shape(shape), name=name)


def _initializer(graph: ir.Graph, tensor) -> ir.Value:
    value = ir.Value(name=tensor.name, shape=tensor.shape, type=ir.TensorType(tensor.dtype), const_value=tensor)
    graph.register_initializer(value)
    return value


def _fuse(graph: ir.Graph, group: list[_Member], index: int, table: WeightTable) -> int:
    """Replace one group, recording in `table` which slice of the fused weight and bias each
    projection's own became; return how many nodes the graph lost."""
    first = group[0]
    x, op, dtype, trans_b = first.node.inputs[0], first.node.op_type, first.weight.const_value.dtype, first.trans_b
    prefix = f"qkv_fused_{index}"
    axis = 0 if trans_b else 1
    weight = _initializer(graph, _lazy_concat([m.weight.const_value for m in group], axis, f"{prefix}.weight"))
    table.concatenated(weight.name, [(m.weight.name, m.width) for m in group], axis, weight.shape, dtype_name(dtype))
    bias = None
    if any(m.bias is not None for m in group):
        parts = [m.bias.const_value if m.bias is not None else ir.tensor(np.zeros(m.width, dtype.numpy()))
                 for m in group]
        bias = _initializer(graph, _lazy_concat(parts, 0, f"{prefix}.bias"))
        table.concatenated(bias.name, [(m.bias.name if m.bias is not None else "", m.width) for m in group], 0,
                           bias.shape, dtype_name(dtype))
    new_nodes = []
    if op == "Gemm":
        gemm = ir.node("Gemm", [x, weight] + ([bias] if bias is not None else []),
                       attributes={"transB": int(trans_b)}, name=f"{prefix}.gemm")
        new_nodes.append(gemm)
        fused = gemm.outputs[0]
    else:
        matmul = ir.node("MatMul", [x, weight], name=f"{prefix}.matmul")
        new_nodes.append(matmul)
        fused = matmul.outputs[0]
        if bias is not None:
            add = ir.node("Add", [fused, bias], name=f"{prefix}.bias_add")
            new_nodes.append(add)
            fused = add.outputs[0]
    widths = _initializer(graph, ir.tensor(np.array([m.width for m in group], np.int64), name=f"{prefix}.widths"))
    split = ir.node("Split", [fused, widths], attributes={"axis": -1}, num_outputs=len(group), name=f"{prefix}.split")
    new_nodes.append(split)
    for node in new_nodes:  # what module the fused nodes came from (quantization keeps some modules in float)
        node.metadata_props.update(first.node.metadata_props)
    old_outputs = [m.output for m in group]
    for old, new in zip(old_outputs, split.outputs):
        new.name, new.shape, new.type = f"{prefix}.{old.name}", old.shape, old.type
    for node in new_nodes[:-1]:  # the projection before and after its bias: what the passes after it read
        node.outputs[0].type = old_outputs[0].type
        if old_outputs[0].shape is not None:
            node.outputs[0].shape = ir.Shape(list(old_outputs[0].shape)[:-1] + [sum(m.width for m in group)])
    members = {id(m.node) for m in group}  # the first in graph order, found in one walk (graph.index is O(n))
    graph.insert_before(next(n for n in graph if id(n) in members), new_nodes)
    for old, new in zip(old_outputs, split.outputs):
        replace_uses(old, new)
    old_nodes = [n for m in group for n in (m.node, m.bias_add) if n is not None]
    graph.remove(old_nodes, safe=True)
    for value in {id(v): v for m in group for v in (m.weight, m.bias) if v is not None}.values():
        if not value.uses() and not value.is_graph_output():
            graph.initializers.pop(value.name)
    return len(old_nodes) - len(new_nodes)


class FuseQKV(GraphPass):
    name = "fuse_qkv"
    summary = "projections of one tensor (q/k/v, gates, adaLN) become one MatMul + bias Add + Split"

    def call(self, model: ir.Model) -> Report:
        groups = find_groups(model.graph)
        nodes_removed = sum(_fuse(model.graph, group, i, self.context.weights) for i, group in enumerate(groups))
        counts = {"groups": len(groups), "projections_fused": sum(len(g) for g in groups), "nodes_removed": nodes_removed}
        return Report(model, modified=bool(groups), counts=counts)
