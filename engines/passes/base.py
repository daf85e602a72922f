"""What a graph pass is: a named unit that returns the model and a report of what it did.

Built on onnx-ir's pass infrastructure (`requires` / `call` / `ensures`, in-place or
functional). Our result adds `counts`: how many groups were fused, nodes removed and so on,
which the manifest records and the tests assert.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import onnx_ir as ir
from onnx_ir.passes import FunctionalPass, InPlacePass, PassResult

__all__ = ["GraphPass", "LibraryPass", "Report"]


@dataclasses.dataclass
class Report(PassResult):
    """`PassResult` plus counts of what changed ({"groups": 12, "nodes_removed": 24})."""

    counts: dict[str, int] = dataclasses.field(default_factory=dict)


class GraphPass(InPlacePass):
    """A pass of ours that edits an onnx-ir model in place.

    Weights stay where they are: an initializer loaded from external data is a memory-mapped
    `ExternalTensor`, and a pass that makes new weights makes them as `LazyTensor`s that are
    computed one at a time when the model is saved.
    """

    name: str = ""
    summary: str = ""

    def call(self, model: ir.Model) -> Report:
        counts = self.apply(model)
        return Report(model, modified=any(counts.values()), counts=counts)

    def apply(self, model: ir.Model) -> dict[str, int]:
        raise NotImplementedError


class LibraryPass(FunctionalPass):
    """A pass done by onnx-graphsurgeon or polygraphy, which work on `onnx.ModelProto`.

    The model crosses over without its weights: initializers held in external data stay
    references in the proto (the libraries copy them through untouched), and come back as
    the same memory-mapped tensors.
    """

    name: str = ""
    summary: str = ""

    def call(self, model: ir.Model) -> Report:
        base_dir = _base_dir(model)
        proto = ir.to_proto(model)
        before = len(proto.graph.node)
        proto, counts = self.transform(proto)
        out = ir.from_proto(proto)
        if base_dir is not None:
            ir.external_data.set_base_dir(out.graph, base_dir)
        counts = {"nodes_removed": before - len(proto.graph.node), **counts}
        return Report(out, modified=any(counts.values()), counts=counts)

    def transform(self, proto):  # -> (onnx.ModelProto, counts)
        raise NotImplementedError


def _base_dir(model: ir.Model) -> Path | None:
    for value in model.graph.initializers.values():
        if isinstance(value.const_value, ir.ExternalTensor):
            return Path(value.const_value.base_dir)
    return None


def quiet_polygraphy() -> None:
    """Polygraphy logs every fold at INFO, and ONNX Runtime's symbolic shape inference (which it
    calls) warns about every comparison of symbolic dims it cannot decide; our own log line
    reports the counts."""
    import logging

    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.ERROR
    logging.getLogger("onnxruntime.tools.symbolic_shape_infer").setLevel(logging.ERROR)
