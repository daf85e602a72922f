"""Constant folding, done by polygraphy (onnx-graphsurgeon + ONNX Runtime).

Not onnxscript's folder: on sd3-tiny's export it folds none of the 16 nodes polygraphy folds (its
partial evaluation does not reach Slice(Shape(x)) of the static trailing dims the dynamo exporter
leaves), and the exporter has already run it.

The weights `LibraryPass` holds back reach polygraphy as graph inputs, not as constants: a subgraph
that reads one is not constant to it, so it neither tries to read the weight (onnx-graphsurgeon
evaluates all constant subgraphs in one ONNX Runtime session, and one unreadable weight made that
session fail and every fold of the graph be skipped) nor copies it into a folded one.
"""
from __future__ import annotations

from engines.passes.base import HELD, LibraryPass, Transformed

# Folding must not turn a small graph into a large one (e.g. by expanding a broadcast).
MAX_FOLDED_BYTES = 16 * 2**20


def _held(proto) -> list:
    return [t for t in proto.graph.initializer if any(e.key == "location" and e.value == HELD for e in t.external_data)]


class FoldConstants(LibraryPass):
    name = "fold_constants"
    summary = "polygraphy: replace every subgraph that reads only constants by its value"

    def transform(self, proto) -> Transformed:
        from onnx import helper
        from polygraphy.backend.onnx import fold_constants

        held = _held(proto)
        names = {t.name for t in held}
        kept = [t for t in proto.graph.initializer if t.name not in names]
        del proto.graph.initializer[:]
        proto.graph.initializer.extend(kept)
        inputs = len(proto.graph.input)
        proto.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, t.dims) for t in held)
        nodes, before = len(proto.graph.node), len(proto.graph.initializer)
        # error_ok=False: a fold that fails is an error here, not a silently skipped pass.
        # ONNX's shape inference between passes, not ONNX Runtime's symbolic one: the same folds on every
        # family's export, in a tenth of the time (20 s of sympy on sd15-tiny's U-Net).
        out = fold_constants(proto, error_ok=False, size_threshold=MAX_FOLDED_BYTES,
                             allow_onnxruntime_shape_inference=False)
        added = len(out.graph.initializer) - before
        graph_inputs = [i for i in out.graph.input if i.name not in names]
        del out.graph.input[:]
        out.graph.input.extend(graph_inputs)
        out.graph.initializer.extend(held)
        if len(out.graph.input) != inputs:
            raise RuntimeError(f"polygraphy returned {len(out.graph.input)} graph inputs, not {inputs}")
        return Transformed(out, modified=bool(added or nodes != len(out.graph.node)), counts={"constants_added": added})
