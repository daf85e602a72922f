"""Shape inference, done by polygraphy (ONNX's shape inference, external data kept aside)."""
from __future__ import annotations

from engines.passes.base import LibraryPass, quiet_polygraphy


class InferShapes(LibraryPass):
    name = "infer_shapes"
    summary = "polygraphy: annotate every intermediate tensor with its dtype and (symbolic) shape"

    def transform(self, proto):
        from polygraphy.backend.onnx import infer_shapes

        quiet_polygraphy()
        known = {vi.name: vi for vi in proto.graph.value_info}
        out = infer_shapes(proto, error_ok=False)
        # ONNX's inference drops the exporter's symbolic shapes it cannot re-derive (e.g. after a
        # Reshape to a computed shape): keep those, so the pass only ever adds information.
        inferred = {vi.name for vi in out.graph.value_info}
        out.graph.value_info.extend(vi for name, vi in known.items() if name not in inferred)
        return out, {"shapes_added": len(out.graph.value_info) - len(known)}
