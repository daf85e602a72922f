"""Memory-aware schedule: the nodes in the order that keeps the fewest bytes live.

The planner's greedy list schedule (`engines.memory.planner.memory_order`) runs, of the nodes
whose inputs are ready, the one that adds the fewest live bytes: a 1x1 shortcut conv runs as soon
as its input exists, so the input's buffer is free once the main branch has read it, and
independent branches run in the order that frees most. The order is kept only if the planned peak
at the context's dims is lower. The pass asks ONNX Runtime, in the graph's metadata, to keep it:
- `execution_order = PRIORITY_BASED`: its default order ignores the file's;
- no `ConvAddActivationFusion`: it fuses a 1x1 shortcut conv into the residual Add at the block's
  end, which moves the conv there and keeps its 1 GiB input alive across the whole block
  (measured on sd3-bench's VAE decoder at 1024x1024).
"""
from __future__ import annotations

import onnx_ir as ir

from engines.memory.graph import graph_of
from engines.memory.planner import memory_order, plan
from engines.passes.base import GraphPass, Report
from engines.passes.ort_tools import request_session_options


class ScheduleMemory(GraphPass):
    name = "schedule_memory"
    summary = "reorder nodes so the fewest activation bytes are live at once (ORT: PRIORITY_BASED order)"
    plans_memory = True

    def call(self, model: ir.Model) -> Report:
        graph = graph_of(model, self.context.dims)
        before = plan(graph)
        order = memory_order(graph)
        after = plan(graph, order)
        moved = sum(i != j for i, j in enumerate(order))
        if after.peak >= before.peak:
            order, after, moved = before.order, before, 0
        nodes = list(model.graph)
        if moved:
            model.graph.remove(nodes, safe=False)
            model.graph.extend(nodes[i] for i in order)
        request_session_options(model, execution_order="PRIORITY_BASED", disabled_optimizers=["ConvAddActivationFusion"])
        counts = {"nodes_moved": moved, "peak_before": before.peak, "peak_after": after.peak}
        return Report(model, modified=bool(moved), counts=counts,
                      details={"dims": self.context.dims, "peak_node": nodes[order[after.peak_step]].name})
