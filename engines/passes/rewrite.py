"""What the passes that rewrite subgraphs share: matching helpers and a builder for the new nodes."""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

MS_DOMAIN = "com.microsoft"


def only_use(value: ir.Value) -> ir.Node | None:
    """The one node that reads `value`, if exactly one does and it is not a graph output."""
    uses = value.uses()
    return uses[0].node if len(uses) == 1 and not value.is_graph_output() else None


def replace_uses(old: ir.Value, new: ir.Value) -> None:
    """Every reader of `old` reads `new`; where `old` is a graph output, `new` takes its place and
    its name (the runner reads outputs by name)."""
    name = old.name if old.is_graph_output() else None
    ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    if name is not None:
        old.name, new.name = f"{name}.replaced", name


def is_op(node: ir.Node | None, op: str) -> bool:
    return node is not None and node.op_type == op and node.domain == ""


def scalar(value: ir.Value | None) -> float | None:
    """The value of a one-element constant, else None."""
    c = None if value is None else value.const_value
    if c is None or c.size != 1:
        return None
    return float(c.numpy().reshape(()))


class Builder:
    """Collects the nodes of one replacement, named under `prefix`, with its constants registered
    once per graph; `insert_before(anchor)` puts them in the graph."""

    def __init__(self, graph: ir.Graph, prefix: str):
        self.graph, self.prefix, self.nodes = graph, prefix, []

    def op(self, op_type: str, inputs, domain: str = "", **attrs) -> ir.Value:
        return self.ops(op_type, inputs, 1, domain, **attrs)[0]

    def ops(self, op_type: str, inputs, outputs: int, domain: str = "", **attrs) -> list[ir.Value]:
        """`op` for an op with several outputs, named `<node>.<i>`."""
        node = ir.node(op_type, inputs, attributes=attrs or None, domain=domain, num_outputs=outputs,
                       name=f"{self.prefix}.{op_type}_{len(self.nodes)}")
        for i, value in enumerate(node.outputs):
            value.name = node.name if outputs == 1 else f"{node.name}.{i}"
        self.nodes.append(node)
        return list(node.outputs)

    def const(self, name: str, values, dtype=np.int64) -> ir.Value:
        """A constant shared by the graph under `name` (the caller makes the name unique to its values)."""
        if name not in self.graph.initializers:
            t = ir.tensor(np.asarray(values, dtype), name=name)
            self.graph.register_initializer(ir.Value(name=name, shape=t.shape, type=ir.TensorType(t.dtype),
                                                     const_value=t))
        return self.graph.initializers[name]

    def insert_before(self, anchor: ir.Node) -> None:
        self.graph.insert_before(anchor, self.nodes)
