"""Constant folding, done by polygraphy (onnx-graphsurgeon + ONNX Runtime)."""
from __future__ import annotations

from engines.passes.base import LibraryPass, quiet_polygraphy

# Folding must not turn a small graph into a large one (e.g. by expanding a broadcast).
MAX_FOLDED_BYTES = 16 * 2**20


class FoldConstants(LibraryPass):
    name = "fold_constants"
    summary = "polygraphy: replace every subgraph that reads only constants by its value"

    def transform(self, proto):
        from polygraphy.backend.onnx import fold_constants

        quiet_polygraphy()
        before = len(proto.graph.initializer)
        # error_ok=False: a fold that fails is an error here, not a silently skipped pass.
        out = fold_constants(proto, error_ok=False, size_threshold=MAX_FOLDED_BYTES)
        return out, {"constants_added": len(out.graph.initializer) - before}
