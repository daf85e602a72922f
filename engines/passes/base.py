"""What a graph pass is: a named unit that returns the model and a report of what it did.

Built on onnx-ir's pass infrastructure: `PassBase.__call__` runs `requires(model)`, then
`call(model)`, then `ensures(result.model)`. Our contract on top of it:

- `requires` refuses a model the pass cannot work on, naming the pass: a pass that reads tensor
  shapes (`needs_shapes`) refuses a graph whose intermediate tensors have none, and a pass that
  measures the model (`needs_calibration`) refuses to run without calibration inputs.
- `ensures` checks that the graph's inputs and outputs kept their names, dtypes and ranks (the
  runner's contract), naming the pass that changed them.
- `call` returns a `Report` whose `modified` the pass sets itself, from what it did (a quantizer
  that quantized nothing reports modified=False even though it counted the layers it kept).
- The `PassContext` is given to the constructor: one pass object per submodule.
"""
from __future__ import annotations

import dataclasses

import onnx_ir as ir
from onnx_ir.passes import FunctionalPass, InPlacePass, PassBase, PassResult, PostconditionError, PreconditionError

from runners.adapters.provenance import WeightTable

__all__ = ["GraphPass", "LibraryPass", "PassContext", "Report", "Transformed"]


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
    pipeline makes each submodule's passes with it."""

    submodule: str = "model"
    entry: dict = dataclasses.field(default_factory=dict)
    calibration: object | None = None  # engines.calibration.CalibrationFeeds
    # The memory passes plan at these dims ({dim name: value}, the export's opt shape by default)
    # and lower the peak until it is at most `memory_budget` bytes (None: as far as they can).
    dims: dict = dataclasses.field(default_factory=dict)
    memory_budget: int | None = None
    # Where each weight comes from (runners/adapters/provenance.py): the pipeline drops the records of the
    # weights a pass removed; a pass that makes a weight from others records how.
    weights: WeightTable = dataclasses.field(default_factory=WeightTable)


def signature(model: ir.Model) -> dict[str, list[tuple]]:
    """The graph's inputs and outputs as (name, dtype, rank): what the runner feeds and reads."""
    def described(values):
        return [(v.name, v.dtype, None if v.shape is None else len(v.shape)) for v in values]

    return {"inputs": described(model.graph.inputs), "outputs": described(model.graph.outputs)}


def _unchanged(before: tuple, after: tuple) -> bool:
    """A dtype or rank unknown before may become known (shape inference adds it); a known one stays."""
    return before[0] == after[0] and all(b is None or b == a for b, a in zip(before[1:], after[1:]))


class _Contract(PassBase):
    """What every pass of ours declares and checks (see the module docstring)."""

    name: str = ""
    summary: str = ""
    needs_calibration = False  # measures the model on calibration inputs (engines/calibration.py)
    needs_shapes = False  # reads the shapes of intermediate tensors (run infer_shapes before it)
    plans_memory = False  # runs the planner of engines/memory (its code is part of the artifact's cache key)

    def __init__(self, context: PassContext | None = None):
        self.context = context or PassContext()
        self._signature: dict | None = None

    def requires(self, model: ir.Model) -> None:
        self._signature = signature(model)
        where = self.context.submodule
        if self.needs_calibration and self.context.calibration is None:
            raise PreconditionError(f"pass '{self.name}' measures the model on calibration inputs, and none were "
                                    f"given for {where} (engines.calibration.collect records them)")
        if self.needs_shapes:
            values = [v for node in model.graph for v in node.outputs]
            unknown = [v.name for v in values if v.shape is None or v.dtype is None]
            if unknown:
                raise PreconditionError(
                    f"pass '{self.name}' reads tensor shapes, and {len(unknown)} of the {len(values)} tensors of "
                    f"{where} have none (e.g. {', '.join(unknown[:3])}): run infer_shapes before it")

    def ensures(self, model: ir.Model) -> None:
        after = signature(model)
        for side, before in self._signature.items():
            now = after[side]
            if len(now) != len(before) or not all(map(_unchanged, before, now)):
                raise PostconditionError(
                    f"pass '{self.name}' changed the {side} of {self.context.submodule} from {before} to {now}: "
                    f"a pass must keep the graph's input and output names, dtypes and ranks")


class GraphPass(_Contract, InPlacePass):
    """A pass of ours that edits an onnx-ir model in place; `call` returns its `Report`.

    Weights stay where they are: an initializer loaded from external data is a memory-mapped
    `ExternalTensor`, and a pass that makes new weights makes them as `LazyTensor`s that are
    computed one at a time when the model is saved.
    """

    def call(self, model: ir.Model) -> Report:
        raise NotImplementedError


@dataclasses.dataclass
class Transformed:
    """What a `LibraryPass.transform` returns: the library's model, whether it changed anything
    (the pass says so itself), its counts and details."""

    proto: object  # onnx.ModelProto
    modified: bool
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    details: dict = dataclasses.field(default_factory=dict)


class LibraryPass(_Contract, FunctionalPass):
    """A pass done by onnx-graphsurgeon, polygraphy or ONNX Runtime's tools, which work on
    `onnx.ModelProto`.

    The model crosses over without its weights: every initializer over `HELD_BYTES` goes into
    the proto as an external-data reference to a file that does not exist, so the libraries
    copy it through untouched and cannot read it, and it comes back as the same tensor object
    (memory-mapped, lazy or in memory, as it was). Without this, a 1.5 GB graph was copied
    several times over on its way through polygraphy. A library step that needs a held weight's
    values must not see it as a constant (`fold_constants` hands them over as graph inputs).
    """

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
        done = self.transform(proto)
        out = ir.from_proto(done.proto)
        _restore_node_metadata(model, out)
        for name, value in out.graph.initializers.items():
            tensor = value.const_value
            if isinstance(tensor, ir.ExternalTensor) and tensor.location == HELD:
                if name not in held:  # a library renamed or made a reference: never silently lose a weight
                    raise RuntimeError(f"{self.name}: initializer '{name}' came back as a reference to no weight")
                value.const_value = held[name]
        delta = before - len(done.proto.graph.node)
        counts = {("nodes_removed" if delta >= 0 else "nodes_added"): abs(delta), **done.counts}
        return Report(out, modified=done.modified, counts=counts, details=done.details)

    def transform(self, proto) -> Transformed:
        raise NotImplementedError


def _restore_node_metadata(before: ir.Model, after: ir.Model) -> None:
    """onnx-graphsurgeon drops node metadata; give every node that kept its name its metadata back
    (the exporter's module name scopes, which say what a node belongs to: quantization reads them)."""
    metadata = {n.name: n.metadata_props for n in before.graph if n.name and n.metadata_props}
    for node in after.graph:
        if node.name in metadata and not node.metadata_props:
            node.metadata_props.update(metadata[node.name])


HELD = "__weight_held_by_diffusion_aot__"  # the file a held weight refers to


def to_proto_without(model: ir.Model, held: dict):
    """`ir.to_proto(model)` with the `held` initializers as references to `HELD`: their shapes
    and types without their bytes. Every other weight crosses as data, also one that a graph over
    2 GB keeps in its external file (shapes and axes there are what the libraries read). The
    model is left as it was."""
    values = model.graph.initializers
    external = {name: v.const_value for name, v in values.items()
                if name not in held and isinstance(v.const_value, ir.ExternalTensor)}
    try:
        for name, tensor in held.items():
            values[name].const_value = ir.ExternalTensor(HELD, 0, tensor.nbytes, tensor.dtype,
                                                         shape=tensor.shape, name=name)
        for name, tensor in external.items():
            values[name].const_value = ir.Tensor(tensor.numpy(), name=name)
        return ir.to_proto(model)
    finally:
        for name, tensor in {**held, **external}.items():
            values[name].const_value = tensor
