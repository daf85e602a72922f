"""Attention fusion for ONNX Runtime: the exported attention subgraph becomes one
`com.microsoft.MultiHeadAttention` node.

Matched (BNSH = batch, heads, sequence, head dim):

    Q' = Q * s1   Kt' = Kt * s2                 (either scale optional)
    scores = MatMul(Q', Kt') [* s3] [+ bias ...]   (a bias (B|1, N|1, S, L), or a (B|1, 1, 1, L) key mask)
    P = Softmax(scores, axis=-1)  [Where(IsNaN(P), 0, P)]
    out = Reshape(Transpose(MatMul(P, V), (0,2,1,3)) [* row], (B, S, N*D))

where row is a (B|1, S, 1, 1) multiplier of each query's output (0 for a query allowed no key: the sdpa rule
our LLM encoders are traced with, export/families/llm_encoder.py), and Kt is K transposed, either as
Transpose(K, (0,1,3,2)), Transpose(K_bsnh, (0,2,3,1)) or the Reshape/Transpose(0,2,1)/Reshape chain the
dynamo exporter writes for SDPA. The score matrices are no longer graph tensors that ONNX Runtime
allocates (the pass table in BENCHMARKS.md shows the lower peak). A key mask (Qwen-Image's padded
text) is expanded over the queries, as attention_bias must be: (B, 1, S, L), one head's scores
where the unfused graph held several tensors of B * N (its Edit model's ort-fp32 run at 5k tokens
with CFG ran out of this machine's 24 GiB unfused).
ONNX Runtime's CPU kernel runs as flash attention only without a bias or mask; with one it holds the
(B, N, S, L) probabilities of the whole node. Where they would exceed SCORES_BOUND at the plan dims
(the export's opt shape: Qwen-Image-Edit's 5.6k tokens at batch 2 made 6 GiB), the heads are fused
in groups, one node each, run one after another: each row of each head is the same computation.
TensorRT targets keep the plain pattern: TensorRT fuses it itself.

The pass reads shapes (the head count from Q's, the operands' ranks, a bias's query axis, the
probabilities' size at the plan dims), so it declares `needs_shapes`: on a graph without them it
fails instead of fusing nothing.

Why not onnxscript's rewriter: its `ort_fusions.sdpa` rule matches the same MatMul/Softmax/MatMul
core (the three key layouts, the scales, the NaN guard), and `sdpa_via_mha` lowers it to
MultiHeadAttention, but measured on sd3-tiny's graphs (after fuse_qkv) it does less:
- T5 (text_encoder_3): 0 of 2 attentions (no scale at all, and a position bias plus a mask: two
  Adds, where its pattern takes one);
- elsewhere the same attentions (2, 2, 2, 1, 1), but the graph keeps every Transpose and Reshape
  around them and gains an Expand for the mask and a Reshape/Transpose back to BNSH: CLIP 95 -> 97
  nodes (this pass: 95 -> 65), the transformer 241 -> 237 (this pass: 212), the VAEs -2 (this pass
  -15);
- a (B, 1, 1, L) padding mask is broadcast with an Expand to a full score-size tensor, where this
  pass expands it over the query axis only.
Our matcher as one rule of that rewriter (OrValue for zero to two biases, the BSNH views chosen in
the rewrite from the operands' producers) is possible and not done yet: the counts above are its
test oracle.
"""
from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from engines.passes.base import GraphPass, Report
from engines.passes.rewrite import MS_DOMAIN, Builder, is_op, only_use, replace_uses, scalar


# The most one fused node's float32 probabilities may take at the plan dims (PassContext.dims, the export's opt
# shape) where it holds them: past it, its heads are fused in groups (_head_groups).
SCORES_BOUND = 2**30
_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def _perm(node: ir.Node) -> tuple[int, ...]:
    attr = node.attributes.get("perm")
    return tuple(attr.value) if attr is not None else ()


def _strip_scale(value: ir.Value) -> tuple[ir.Value, float]:
    """x * s (or s * x, or x / s) with a scalar constant s -> (x, s)."""
    node = value.producer()
    if is_op(node, "Mul") or is_op(node, "Div"):
        for i in (1, 0) if node.op_type == "Mul" else (1,):
            s = scalar(node.inputs[i])
            if s is not None:
                return node.inputs[1 - i], (s if node.op_type == "Mul" else 1.0 / s)
    return value, 1.0


def _reaches_matmul(value: ir.Value, depth: int = 4) -> bool:
    """Whether `value` is the Q.Kt product, possibly scaled and with biases already added."""
    node = value.producer()
    if depth == 0 or node is None:
        return False
    if is_op(node, "MatMul"):
        return True
    if is_op(node, "Add"):
        return any(_reaches_matmul(i, depth - 1) for i in node.inputs)
    inner, _ = _strip_scale(value)
    return inner is not value and _reaches_matmul(inner, depth - 1)


def _per_query(bias: ir.Value) -> bool:
    """Whether a bias is (B|1, N|1, S, L), the shape attention_bias takes (not a (B, 1, 1, L) mask)."""
    shape = bias.shape
    return shape is not None and len(shape) == 4 and shape[2] != 1


def _key_mask(bias: ir.Value) -> bool:
    """Whether a bias is a (B|1, 1, 1, L) key mask: attention_bias takes it expanded over the queries."""
    shape = bias.shape
    return shape is not None and len(shape) == 4 and shape[1] == 1 and shape[2] == 1


@dataclass
class _Heads:
    """One attention operand in the forms MultiHeadAttention takes: BNSH (4-D) or BSH (3-D)."""

    bnsh: ir.Value | None = None
    bsnh: ir.Value | None = None  # reshaped to BSH for free (a view)


def _from_bnsh(value: ir.Value) -> _Heads:
    node = value.producer()
    if is_op(node, "Transpose") and _perm(node) == (0, 2, 1, 3):
        return _Heads(bnsh=value, bsnh=node.inputs[0])
    return _Heads(bnsh=value)


def _key_from_transposed(kt: ir.Value) -> _Heads | None:
    node = kt.producer()
    if is_op(node, "Transpose") and _perm(node) == (0, 1, 3, 2):
        return _from_bnsh(node.inputs[0])
    if is_op(node, "Transpose") and _perm(node) == (0, 2, 3, 1):
        return _Heads(bsnh=node.inputs[0])
    # SDPA's decomposition: Reshape(K, (B*N, L, D)) -> Transpose(0,2,1) -> Reshape(B, N, D, L)
    if is_op(node, "Reshape"):
        t = node.inputs[0].producer()
        if is_op(t, "Transpose") and _perm(t) == (0, 2, 1):
            r = t.inputs[0].producer()
            if is_op(r, "Reshape") and r.inputs[0].shape is not None and len(r.inputs[0].shape) == 4:
                return _from_bnsh(r.inputs[0])
    return None


@dataclass
class _Match:
    softmax: ir.Node
    query: _Heads
    key: _Heads
    value: _Heads
    biases: list[ir.Value]
    scale: float
    num_heads: int
    output: ir.Value  # the (B, S, N*D) tensor the fused node produces
    row: ir.Value | None  # a (B|1, S, 1, 1) multiplier of each query's output, applied after the fused node


def _match(softmax: ir.Node) -> _Match | None:
    axis = softmax.attributes.get("axis")
    if (axis.value if axis is not None else -1) not in (-1, 3):
        return None
    # Upstream: additive biases, an optional scale, the Q.Kt MatMul.
    biases, scores = [], softmax.inputs[0]
    while is_op(scores.producer(), "Add") and only_use(scores) is not None:
        add = scores.producer()
        on_path = [i for i in add.inputs if _reaches_matmul(i)]
        if len(on_path) != 1:
            return None
        biases.append(add.inputs[1] if add.inputs[0] is on_path[0] else add.inputs[0])
        scores = on_path[0]
    if biases and not any(_per_query(b) or _key_mask(b) for b in biases):
        return None  # not a shape attention_bias takes, even expanded over the queries: leave it unfused
    scores, scale = _strip_scale(scores)
    qk = scores.producer()
    if not is_op(qk, "MatMul") or only_use(scores) is None:
        return None
    q4, s1 = _strip_scale(qk.inputs[0])
    kt, s2 = _strip_scale(qk.inputs[1])
    key = _key_from_transposed(kt)
    if key is None or q4.shape is None or len(q4.shape) != 4 or not isinstance(q4.shape[1], int):
        return None
    # Downstream: optional NaN guard, P.V, back to (B, S, N*D).
    probs = softmax.outputs[0]
    users = {u.node.op_type: u.node for u in probs.uses()}
    if len(probs.uses()) == 2 and set(users) == {"IsNaN", "Where"} and users["Where"].inputs[2] is probs:
        # SDPA guards fully masked rows (NaN -> 0); causal and text masks never mask a whole row.
        probs = users["Where"].outputs[0]
    use = only_use(probs)
    if not is_op(use, "MatMul") or use.inputs[0] is not probs:
        return None
    transpose = only_use(use.outputs[0])
    if not is_op(transpose, "Transpose") or _perm(transpose) != (0, 2, 1, 3):
        return None
    reshape, row = only_use(transpose.outputs[0]), None
    if is_op(reshape, "Mul"):
        other = reshape.inputs[1 if reshape.inputs[0] is transpose.outputs[0] else 0]
        if other.shape is not None and len(other.shape) == 4 and list(other.shape)[2:] == [1, 1]:
            row, reshape = other, only_use(reshape.outputs[0])
    out = reshape.outputs[0] if is_op(reshape, "Reshape") else None
    if out is None or out.shape is None or len(out.shape) != 3:
        return None
    return _Match(softmax, _from_bnsh(q4), key, _from_bnsh(use.inputs[1]), biases, s1 * s2 * scale,
                  q4.shape[1], out, row)


def _to_bsh(b: Builder, heads: _Heads) -> ir.Value:
    if heads.bsnh is None:
        heads.bsnh = b.op("Transpose", [heads.bnsh], perm=[0, 2, 1, 3])
    return b.op("Reshape", [heads.bsnh, b.const("attention_fused.bsh_shape", [0, 0, -1])])


def _to_bnsh(b: Builder, heads: _Heads) -> ir.Value:
    return heads.bnsh if heads.bnsh is not None else b.op("Transpose", [heads.bsnh], perm=[0, 2, 1, 3])


def _size(dim, dims: dict) -> int | None:
    """A dimension's size at `dims`: an int, or a symbolic one as shape inference writes it ("text_length +
    image_tokens"); None where it names anything else."""
    if isinstance(dim, int):
        return dim

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return dims.get(node.id)
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
            left, right = value(node.left), value(node.right)
            return None if left is None or right is None else _ARITHMETIC[type(node.op)](left, right)
        return None

    try:
        return value(ast.parse(str(dim.value), mode="eval").body)
    except SyntaxError:
        return None


def _head_dim(heads: _Heads) -> int | None:
    shape = (heads.bnsh if heads.bnsh is not None else heads.bsnh).shape
    return shape[3] if shape is not None and isinstance(shape[3], int) else None


def _head_groups(m: _Match, dims: dict) -> int:
    """Into how many groups of heads the attention is fused: one, unless it holds its probabilities (a bias or a
    mask: no flash attention) and they would exceed SCORES_BOUND at `dims`; then the fewest groups that keep one
    group's within it (each group of heads is its own node, run one after another)."""
    if not m.biases or None in map(_head_dim, (m.query, m.key, m.value)):  # (the operands' shapes are known)
        return 1
    batch, _, queries, _ = m.query.bnsh.shape
    keys = m.key.bnsh.shape[2] if m.key.bnsh is not None else m.key.bsnh.shape[1]
    sizes = [_size(d, dims) for d in (batch, queries, keys)]
    if None in sizes:
        return 1
    scores = 4 * m.num_heads * math.prod(sizes)  # float32 probabilities: the kernel computes in fp32
    return next(g for g in range(1, m.num_heads + 1)
                if m.num_heads % g == 0 and (scores // g <= SCORES_BOUND or g == m.num_heads))


def _split_heads(b: Builder, value: ir.Value, axis: int, per_group: int, groups: int, head_dim: int | None = 1):
    """`value`'s heads in `groups` groups: (B, S, N * head_dim) along axis 2, (B, N, S, D) along axis 1."""
    if groups == 1:
        return [value]
    size = per_group * head_dim
    return b.ops("Split", [value, b.const(f"attention_fused.split_{size}x{groups}", [size] * groups)], groups,
                 axis=axis)


def _replace(graph: ir.Graph, m: _Match, index: int, groups: int) -> None:
    b = Builder(graph, f"attention_fused_{index}")
    per_group = m.num_heads // groups
    q = _split_heads(b, _to_bsh(b, m.query), 2, per_group, groups, _head_dim(m.query))
    if m.key.bsnh is not None and m.value.bsnh is not None:  # both as free (B, L, N*D) views
        k, v = (_split_heads(b, _to_bsh(b, h), 2, per_group, groups, _head_dim(h)) for h in (m.key, m.value))
    else:
        k, v = (_split_heads(b, _to_bnsh(b, h), 1, per_group, groups) for h in (m.key, m.value))
    bias = m.biases[0] if m.biases else None
    for extra in m.biases[1:]:
        bias = b.op("Add", [bias, extra])
    if m.biases and not any(_per_query(x) for x in m.biases):
        # attention_bias must span the query axis: (B, 1, S, L), a head's score size where the unfused graph
        # held B * N of them (ONNX Runtime's kernel takes no key mask as a float bias)
        queries = b.op("Shape", [m.query.bnsh], start=2, end=3)
        ones = b.const("attention_fused.ones2", [1, 1])
        bias = b.op("Expand", [bias, b.op("Concat", [ones, queries, b.const("attention_fused.one", [1])],
                                              axis=0)])
    biases = [bias] * groups
    if any(x.shape is not None and x.shape[1] == m.num_heads for x in m.biases):  # a bias per head
        biases = _split_heads(b, bias, 1, per_group, groups)
    outs = []
    for g in range(groups):
        inputs = [q[g], k[g], v[g]] + ([None, None, biases[g]] if bias is not None else [])  # attention_bias: 5
        mha = ir.node("MultiHeadAttention", inputs, domain=MS_DOMAIN, name=f"attention_fused_{index}.mha{g}",
                      attributes={"num_heads": per_group, "scale": m.scale})
        b.nodes.append(mha)
        group = mha.outputs[0]  # typed here: ONNX's inference does not know the contrib op (to_fp16 reads types)
        group.name, group.type = f"{mha.name}.out", m.output.type
        group.shape = m.output.shape if groups == 1 else ir.Shape([*m.output.shape[:2], per_group * _head_dim(m.value)])
        outs.append(group)
    out = outs[0] if groups == 1 else b.op("Concat", outs, axis=2)
    if m.row is not None:  # (B, S, 1, 1) -> (B, S, 1): each query's multiplier over its N*D outputs
        out = b.op("Mul", [out, b.op("Reshape", [m.row, b.const("attention_fused.bsh_shape", [0, 0, -1])])])
    out.name, out.shape, out.type = f"attention_fused_{index}.out", m.output.shape, m.output.type
    b.insert_before(m.softmax)
    replace_uses(m.output, out)


class FuseAttention(GraphPass):
    name = "fuse_attention"
    summary = "MatMul/Softmax/MatMul attention becomes ONNX Runtime's fused MultiHeadAttention (ORT only)"

    needs_shapes = True  # the head count, the operands' ranks and the biases' query axis come from shapes

    def call(self, model: ir.Model) -> Report:
        graph = model.graph
        matches = [m for m in (_match(n) for n in graph if is_op(n, "Softmax")) if m is not None]
        before = graph.num_nodes()
        groups = [_head_groups(m, self.context.dims) for m in matches]
        for i, (m, g) in enumerate(zip(matches, groups)):
            _replace(graph, m, i, g)
        if matches:
            model.opset_imports.setdefault(MS_DOMAIN, 1)
            graph.sort()  # a row multiplier is computed after the softmax it follows (stable: nothing else moves)
            RemoveUnusedNodesPass()(model)  # the replaced subgraphs, now unread
        counts = {"attentions_fused": len(matches), "nodes_removed": before - graph.num_nodes(),
                  "attentions_in_head_groups": sum(g > 1 for g in groups)}
        return Report(model, modified=bool(matches), counts=counts)
