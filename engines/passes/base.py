"""What a graph pass is: a named unit that returns the model and a report of what it did.

Built on onnx-ir's pass infrastructure (`requires` / `call` / `ensures`, in-place or
functional). Our result adds `counts`: how many groups were fused, nodes removed and so on,
which the manifest records and the tests assert.
"""
from __future__ import annotations

import dataclasses

import onnx_ir as ir
from onnx_ir.passes import FunctionalPass, InPlacePass, PassResult

from runners.provenance import WeightTable

__all__ = ["GraphPass", "LibraryPass", "PassContext", "Report"]


@dataclasses.dataclass
class Report(PassResult):
    """`PassResult` plus counts of what changed ({"groups": 12, "nodes_removed": 24}) and, where a
    pass made choices the user should see (the nodes kept in fp32, the scales it calibrated),
    `details` that the manifest records beside the counts."""

    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    details: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class PassContext:
    """What a pass may know beyond the graph: the submodule's entry in the export manifest (its
    I/O and quantization hints) and, for passes that measure, calibration inputs recorded from the
    fp32 pipeline (`engines/calibration.py`), and for the memory passes the shapes to plan at. The
    pipeline sets it on every pass before a call."""

    submodule: str = "model"
    entry: dict = dataclasses.field(default_factory=dict)
    calibration: object | None = None  # engines.calibration.CalibrationFeeds
    # The memory passes plan at these dims ({dim name: value}, the export's opt shape by default)
    # and lower the peak until it is at most `memory_budget` bytes (None: as far as they can).
    dims: dict = dataclasses.field(default_factory=dict)
    memory_budget: int | None = None
    # Where each weight comes from (runners/provenance.py): the pipeline drops the records of the
    # weights a pass removed; a pass that makes a weight from others records how.
    weights: WeightTable = dataclasses.field(default_factory=WeightTable)


class GraphPass(InPlacePass):
    """A pass of ours that edits an onnx-ir model in place.

    Weights stay where they are: an initializer loaded from external data is a memory-mapped
    `ExternalTensor`, and a pass that makes new weights makes them as `LazyTensor`s that are
    computed one at a time when the model is saved.
    """

    name: str = ""
    summary: str = ""
    needs_calibration = False
    plans_memory = False  # runs the planner of engines/memory (its code is part of the artifact's cache key)
    context = PassContext()

    def call(self, model: ir.Model) -> Report:
        counts = self.apply(model)
        return Report(model, modified=any(counts.values()), counts=counts)

    def apply(self, model: ir.Model) -> dict[str, int]:
        raise NotImplementedError


class LibraryPass(FunctionalPass):
    """A pass done by onnx-graphsurgeon or polygraphy, which work on `onnx.ModelProto`.

    The model crosses over without its weights: every initializer over `HELD_BYTES` goes into
    the proto as an external-data reference to a file that does not exist, so the libraries
    copy it through untouched and cannot read it, and it comes back as the same tensor object
    (memory-mapped, lazy or in memory, as it was). Without this, a 1.5 GB graph was copied
    several times over on its way through polygraphy. A library step that needs a held weight's
    values (folding a Transpose of a weight, say) cannot read it and fails loudly; the dynamo
    exporter's optimizer has already folded those in our graphs.
    """

    name: str = ""
    summary: str = ""
    needs_calibration = False
    plans_memory = False
    context = PassContext()
    HELD_BYTES = 2**20  # smaller constants cross over as data: the libraries fold and inspect those
    EXTERNAL_HELD_BYTES = 1024  # in a >2 GB graph's external file, all but the smallest stay there
    # Precision passes convert or quantize the weights themselves, so they must see them all. They
    # hold one submodule's weights in memory while they run.
    READS_WEIGHTS = False

    def call(self, model: ir.Model) -> Report:
        if self.READS_WEIGHTS:  # the weights cross over as data (the model's own tensors become in-memory ones)
            ir.external_data.load_to_model(model)
        held = {} if self.READS_WEIGHTS else {
            name: v.const_value for name, v in model.graph.initializers.items()
            if v.const_value is not None and v.const_value.nbytes > (
                self.EXTERNAL_HELD_BYTES if isinstance(v.const_value, ir.ExternalTensor) else self.HELD_BYTES)}
        proto = to_proto_without(model, held)
        before = len(proto.graph.node)
        result = self.transform(proto)
        proto, counts, details = result if len(result) == 3 else (*result, {})
        out = ir.from_proto(proto)
        _restore_node_metadata(model, out)
        for name, value in out.graph.initializers.items():
            tensor = value.const_value
            if isinstance(tensor, ir.ExternalTensor) and tensor.location == _HELD:
                if name not in held:  # a library renamed or made a reference: never silently lose a weight
                    raise RuntimeError(f"{self.name}: initializer '{name}' came back as a reference to no weight")
                value.const_value = held[name]
        delta = before - len(proto.graph.node)
        counts = {("nodes_removed" if delta >= 0 else "nodes_added"): abs(delta), **counts}
        return Report(out, modified=any(counts.values()), counts=counts, details=details)

    def transform(self, proto):  # -> (onnx.ModelProto, counts) or (onnx.ModelProto, counts, details)
        raise NotImplementedError


def _restore_node_metadata(before: ir.Model, after: ir.Model) -> None:
    """onnx-graphsurgeon drops node metadata; give every node that kept its name its metadata back
    (the exporter's module name scopes, which say what a node belongs to: quantization reads them)."""
    metadata = {n.name: n.metadata_props for n in before.graph if n.name and n.metadata_props}
    for node in after.graph:
        if node.name in metadata and not node.metadata_props:
            node.metadata_props.update(metadata[node.name])


_HELD = "__weight_held_by_diffusion_aot__"


def to_proto_without(model: ir.Model, held: dict):
    """`ir.to_proto(model)` with the `held` initializers as references to `_HELD`: their shapes
    and types without their bytes. Every other weight crosses as data, also one that a graph over
    2 GB keeps in its external file (shapes and axes there are what the libraries read). The
    model is left as it was."""
    values = model.graph.initializers
    external = {name: v.const_value for name, v in values.items()
                if name not in held and isinstance(v.const_value, ir.ExternalTensor)}
    try:
        for name, tensor in held.items():
            values[name].const_value = ir.ExternalTensor(_HELD, 0, tensor.nbytes, tensor.dtype,
                                                         shape=tensor.shape, name=name)
        for name, tensor in external.items():
            values[name].const_value = ir.Tensor(tensor.numpy(), name=name)
        return ir.to_proto(model)
    finally:
        for name, tensor in {**held, **external}.items():
            values[name].const_value = tensor


def quiet_polygraphy() -> None:
    """Polygraphy logs every fold at INFO, and ONNX Runtime's symbolic shape inference (which it
    calls) warns about every comparison of symbolic dims it cannot decide; our own log line
    reports the counts."""
    import logging

    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.ERROR
    logging.getLogger("onnxruntime.tools.symbolic_shape_infer").setLevel(logging.ERROR)
