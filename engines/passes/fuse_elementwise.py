"""Elementwise fusion for memory: SiLU and CLIP's quick GELU, `x * Sigmoid(x)` and
`x * Sigmoid(a * x)`, become one `com.microsoft.QuickGelu(x, alpha=a)`.

The unfused chain holds three full-size tensors at its Mul (x, the Sigmoid's output and the
product); the fused op holds two. Running GroupNorm's arithmetic in place would save one more, but
ONNX Runtime's CPU kernels for Add, Sub, Mul and Div never write in place (measured, see
`engines/memory/planner.py`), so no rewrite of GroupNorm into them lowers the peak: the pass
leaves GroupNorm as exported.
"""
from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from engines.passes.base import GraphPass, Report
from engines.passes.rewrite import MS_DOMAIN, is_op, only_use, replace_uses, scalar


def _silu(sigmoid: ir.Node) -> tuple[ir.Value, float, ir.Node] | None:
    """Mul(x, Sigmoid(x)) or Mul(x, Sigmoid(x * a)) -> (x, a, the Mul)."""
    mul = only_use(sigmoid.outputs[0])
    if not is_op(mul, "Mul"):
        return None
    x = mul.inputs[0] if mul.inputs[1] is sigmoid.outputs[0] else mul.inputs[1]
    arg, alpha = sigmoid.inputs[0], 1.0
    scaled = arg.producer()
    if arg is not x and is_op(scaled, "Mul"):
        for i in (0, 1):
            a = scalar(scaled.inputs[1 - i])
            if scaled.inputs[i] is x and a is not None:
                arg, alpha = x, a
    return (x, alpha, mul) if arg is x else None


class FuseElementwise(GraphPass):
    name = "fuse_elementwise"
    summary = "SiLU and quick GELU become one QuickGelu: one full-size tensor fewer at each (ORT only)"

    def call(self, model: ir.Model) -> Report:
        graph = model.graph
        before = graph.num_nodes()
        silus = 0
        for sigmoid in list(graph):  # one at a time: a fused SiLU may feed the next match (quick GELU of a SiLU)
            match = _silu(sigmoid) if is_op(sigmoid, "Sigmoid") else None
            if match is None:
                continue
            x, alpha, mul = match
            node = ir.node("QuickGelu", [x], attributes={"alpha": alpha}, domain=MS_DOMAIN, name=f"silu_fused_{silus}")
            out = node.outputs[0]
            out.name, out.shape, out.type = node.name, mul.outputs[0].shape, mul.outputs[0].type
            graph.insert_before(mul, node)
            replace_uses(mul.outputs[0], out)
            silus += 1
        if silus:
            model.opset_imports.setdefault(MS_DOMAIN, 1)
            RemoveUnusedNodesPass()(model)
        return Report(model, modified=bool(silus), counts={"silus": silus, "nodes_removed": before - graph.num_nodes()})
