"""Dead-node removal and topological sort, done by onnx-ir's `RemoveUnusedNodesPass` and
`TopologicalSortPass` on the model itself (no round trip through a protobuf). Like it, the pass
keeps the graph's inputs even when unused: they are the runner's contract."""
from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from engines.passes.base import GraphPass, Report


class RemoveDeadNodes(GraphPass):
    name = "remove_dead_nodes"
    summary = "onnx-ir: drop nodes and initializers no output depends on, sort the rest"

    def call(self, model: ir.Model) -> Report:
        nodes, initializers = model.graph.num_nodes(), len(model.graph.initializers)
        removed = RemoveUnusedNodesPass()(model).modified
        sorted_ = TopologicalSortPass()(model).modified
        counts = {"nodes_removed": nodes - model.graph.num_nodes(),
                  "initializers_removed": initializers - len(model.graph.initializers)}
        return Report(model, modified=removed or sorted_, counts=counts)
