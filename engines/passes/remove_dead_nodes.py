"""Dead-node removal and topological sort, done by onnx-graphsurgeon."""
from __future__ import annotations

from engines.passes.base import LibraryPass


class RemoveDeadNodes(LibraryPass):
    name = "remove_dead_nodes"
    summary = "onnx-graphsurgeon: drop nodes and initializers no output depends on, sort the rest"

    def transform(self, proto):
        import onnx_graphsurgeon as gs

        before = len(proto.graph.initializer)
        graph = gs.import_onnx(proto)
        # The graph's inputs are the runner's contract: keep them even when unused.
        graph.cleanup(remove_unused_graph_inputs=False).toposort()
        out = gs.export_onnx(graph)
        return out, {"initializers_removed": before - len(out.graph.initializer)}
