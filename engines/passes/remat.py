"""Recompute instead of store: a large tensor that waits across a long stretch of the schedule (a
skip connection) is computed again from smaller live tensors right before its late readers.

Greedy: at the planned peak, every tensor that is live but not read there, that was read before
and is read again after, and whose producer is cheap (Resize, Cast, Transpose, an activation, a
Conv whose input is at most half its output) is a candidate. Each is tried on the planner; the one that lowers the peak most per
extra FLOP is applied, and the search repeats until the peak is at most the context's
`memory_budget`, nothing lowers it, or the recomputes would add more than `MAX_EXTRA_FLOPS` of
the graph's work. The report lists every recompute with its bytes and FLOPs, and whether the
budget was met. ONNX Runtime's common-subexpression elimination would merge a recompute back
into its original, so the pass asks for it to be disabled.
"""
from __future__ import annotations

import dataclasses

import onnx_ir as ir

from engines.memory.graph import Node, OpGraph, graph_of
from engines.memory.planner import INPLACE_OPS, plan
from engines.passes.base import GraphPass, Report
from engines.passes.ort_tools import request_session_options

CHEAP_OPS = INPLACE_OPS | {"Resize", "Cast", "Transpose", "Conv"}
MAX_EXTRA_FLOPS = 0.05  # of the graph's FLOPs (2 x multiply-adds)


@dataclasses.dataclass
class Recompute:
    tensor: str
    producer: int  # node index of the original
    readers: list[int]  # the late readers, which read the copy
    bytes: int
    flops: int


def _cheap(graph: OpGraph, i: int, tensor: str) -> bool:
    node = graph.nodes[i]
    inputs = sum(graph.nbytes.get(t, 0) for t in node.inputs)
    if node.op_type not in CHEAP_OPS or len(node.outputs) != 1 or inputs >= graph.nbytes[tensor]:
        return False
    return node.op_type != "Conv" or 2 * inputs <= graph.nbytes[tensor]


def _candidates(graph: OpGraph, order: list[int]) -> list[Recompute]:
    p = plan(graph, order)
    step = p.peak_step
    position = {i: s for s, i in enumerate(order)}
    found = []
    for buf in p.live_at(step):
        t = buf.tensor
        if buf.graph_input or t in graph.outputs or t not in p.producer or not _cheap(graph, p.producer[t], t):
            continue
        readers = sorted({i for i in order if t in graph.nodes[i].inputs}, key=position.get)
        late = [i for i in readers if position[i] > step]
        if late and len(late) < len(readers):  # read before the peak and after it: the wait is the cost
            found.append(Recompute(t, p.producer[t], late, graph.nbytes[t], graph.work(p.producer[t])))
    return found


def _apply(graph: OpGraph, order: list[int], r: Recompute) -> tuple[OpGraph, list[int], str]:
    """The graph and order with `r` done: the copy runs right before the first late reader."""
    original = graph.nodes[r.producer]
    name = f"{r.tensor}.recomputed_{len(graph.nodes)}"
    nodes = list(graph.nodes) + [Node(name, original.op_type, original.domain, original.inputs, (name,))]
    for i in r.readers:
        nodes[i] = dataclasses.replace(nodes[i], inputs=tuple(name if t == r.tensor else t for t in nodes[i].inputs))
    new = dataclasses.replace(graph, nodes=nodes, nbytes={**graph.nbytes, name: r.bytes},
                              flops=graph.flops + [graph.flops[r.producer]],
                              workspace=graph.workspace + [graph.workspace[r.producer]],
                              itemsize={**graph.itemsize, name: graph.itemsize.get(r.tensor, 4)})
    first = min(order.index(i) for i in r.readers)
    return new, order[:first] + [len(graph.nodes)] + order[first:], name


class Remat(GraphPass):
    name = "remat"
    summary = "recompute cheap large tensors before late readers when it lowers the planned peak (under --memory-budget)"
    plans_memory = True

    def call(self, model: ir.Model) -> Report:
        graph = graph_of(model, self.context.dims)
        order = list(range(len(graph.nodes)))
        budget = self.context.memory_budget or 0
        allowed = MAX_EXTRA_FLOPS * sum(graph.work(i) for i in order)
        peak = before = plan(graph, order).peak
        done, extra = [], 0
        while peak > budget:
            tried = []
            for c in _candidates(graph, order):
                if extra + c.flops <= allowed:
                    g, o, name = _apply(graph, order, c)
                    tried.append(((peak - plan(g, o).peak) / max(1, c.flops), c, g, o, name))
            tried = [t for t in tried if t[0] > 0]
            if not tried:
                break
            _, c, graph, order, name = max(tried, key=lambda t: t[0])
            new_peak = plan(graph, order).peak
            done.append({"tensor": c.tensor, "op": graph.nodes[c.producer].op_type, "bytes": c.bytes,
                         "flops": c.flops, "peak_before": peak, "peak_after": new_peak, "copy": name})
            peak, extra = new_peak, extra + c.flops
        if done:
            _rewrite(model, graph, order, done)
            request_session_options(model, disabled_optimizers=["CommonSubexpressionElimination"])
        met = budget == 0 or peak <= budget
        counts = {"recomputed": len(done), "extra_flops": extra, "peak_before": before, "peak_after": peak,
                  "budget_met": int(met)}
        details = {"recomputes": done, "dims": self.context.dims,
                   **({"budget": budget, "budget_unreachable_by": peak - budget} if not met else {})}
        return Report(model, modified=bool(done), counts=counts, details=details)


def _rewrite(model: ir.Model, graph: OpGraph, order: list[int], done: list[dict]) -> None:
    """Make in the onnx-ir model the copies planned on `graph` and put its nodes in `order`. Node i
    of the model is node i of `graph`; the copies come after the model's nodes, in `done`'s order."""
    by_index = list(model.graph)
    values = {v.name: v for n in by_index for v in n.outputs}
    for planned, d in zip(graph.nodes[len(by_index):], done):
        copied = values[d["tensor"]]
        original = copied.producer()
        copy = ir.node(original.op_type, list(original.inputs), domain=original.domain,
                       attributes=dict(original.attributes), name=planned.name)
        out = copy.outputs[0]
        out.name, out.shape, out.type = planned.outputs[0], copied.shape, copied.type
        values[out.name] = out
        by_index.append(copy)
    for j, planned in enumerate(graph.nodes):
        for idx, t in enumerate(planned.inputs):
            node = by_index[j]
            if t and (node.inputs[idx] is None or node.inputs[idx].name != t):
                node.replace_input_with(idx, values[t])
    model.graph.remove(list(model.graph), safe=False)
    model.graph.extend(by_index[i] for i in order)
