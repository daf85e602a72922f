"""Export one submodule to ONNX with the dynamo exporter, name its dynamic axes, and prove it
against PyTorch in ONNX Runtime at two shapes before it counts as done.

The graph is traced without weights and given them from the checkpoint (`export/lazy_weights.py`);
the PyTorch reference for the check is loaded after the graph is written, run, and freed before
ONNX Runtime opens the graph: at no point are two copies of the weights in memory.
"""
from __future__ import annotations

import collections
import gc
import inspect
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from export import lowering
from export.lazy_weights import (attach_weights, checkpoint_index, defer_weight_transposes, loaded_names,
                                 weightless_component)
from export.shapes import concrete
from export.spec import SubmoduleSpec
from export.trace_cache import TraceCache, weightless
from runners.backends import cpu_threads
from runners.manifest import save_graph
from runners.adapters.provenance import WeightTable, initializer_types, table_path

DEFAULT_OPSET = 20  # MatMul/Softmax attention: builds on every target (opset 23's Attention does not)
EXPORT_DTYPES = ("float32", "float16")
# Parity bound relative to max(1, |reference|). fp32: observed ~1e-6, room for summation order
# only. fp16: PyTorch and ONNX Runtime round different intermediates to fp16 (~1e-3 each).
PARITY_RTOL = {"float32": 1e-4, "float16": 2e-2}


class ExportParityError(RuntimeError):
    pass


@dataclass
class ParityResult:
    dims: dict
    max_abs_err: float
    max_abs_ref: float
    rtol: float

    @property
    def ok(self) -> bool:
        return self.max_abs_err <= self.rtol * max(1.0, self.max_abs_ref)


class TypedIO(torch.nn.Module):
    """Runs a submodule wrapper whose weights are in `dtype` on float32 inputs: floating inputs
    are cast to `dtype` (but those at positions `kept`, which the wrapper takes in float32) and
    outputs back to float32, so a graph's I/O are the same whatever its precision. The wrapper's
    children become this module's own: weight names do not change."""

    def __init__(self, wrapper: torch.nn.Module, dtype: str, kept: frozenset = frozenset()):
        super().__init__()
        self._modules.update(wrapper._modules)
        self.__dict__["wrapper"] = wrapper  # not a child: its parameters are already ours
        self.dtype = getattr(torch, dtype)
        self.kept = kept

    def forward(self, *inputs):
        cast = [x.to(self.dtype) if x.is_floating_point() and i not in self.kept else x
                for i, x in enumerate(inputs)]
        return tuple(y.float() for y in self.wrapper(*cast))


def wrapped(spec: SubmoduleSpec, component, dtype: str = "float32") -> torch.nn.Module:
    """The module the exporter traces: the spec's wrapper, with float32 I/O when `dtype` is not, and
    the modules the family keeps in fp32 in an fp16 engine (`fp32_scopes`) kept so in an fp16 export."""
    if dtype == "float32":
        return spec.wrap(component).eval()
    keep_in_fp32(component, spec.quantization.get("fp32_scopes", ()))
    kept = frozenset(i for i, t in enumerate(spec.inputs) if t.name in spec.quantization.get("fp32_inputs", ()))
    return TypedIO(spec.wrap(component).eval(), dtype, kept).eval()


def keep_in_fp32(component: torch.nn.Module, scopes) -> None:
    """Run the modules named in `scopes` in fp32: their weights cast up, their floating inputs cast to
    fp32 and their outputs back to the inputs' dtype (the narrower one, where a timestep came in fp32 beside
    fp16 states: Wan's condition embedder), each output of a tuple too. Flux's timestep embedding takes timesteps
    and guidance times 1000, where fp16's spacing turns its sinusoids' phases wrong (docs/precision.md)."""
    came_in = {}  # module -> its inputs' dtype (a forward hook sees the inputs as cast)

    def up(sub, args, kwargs):
        floating = [a.dtype for a in (*args, *kwargs.values()) if torch.is_tensor(a) and a.is_floating_point()]
        came_in[sub] = next((d for d in floating if d != torch.float32), torch.float32)
        wide = tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
        return wide, {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kwargs.items()}

    def down(sub, args, kwargs, output):
        back = lambda y: y.to(came_in[sub]) if torch.is_tensor(y) and y.is_floating_point() else y  # noqa: E731
        return tuple(map(back, output)) if isinstance(output, tuple) else back(output)

    for name, sub in component.named_modules():
        if name and (name in scopes or name.rsplit(".", 1)[-1] in scopes):
            for holder in sub.modules():  # not .float(): it cannot swap a traced export's FakeTensor weights
                for key, p in holder._parameters.items():
                    if p is not None and p.dtype != torch.float32:
                        holder._parameters[key] = torch.nn.Parameter(p.float(), requires_grad=False)
            sub.register_forward_pre_hook(up, with_kwargs=True)
            sub.register_forward_hook(down, with_kwargs=True)


def example_inputs(spec: SubmoduleSpec, dims: dict, constants: dict, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = []
    for t in spec.inputs:
        shape = concrete(t.shape, dims, constants)
        high = t.high
        if isinstance(high, str):
            high = constants[high] if high in constants else dims[high] + 1
        if t.mask:
            lengths = rng.integers(1, shape[-1] + 1, size=shape[:-1])
            arrays.append((np.arange(shape[-1]) < lengths[..., None]).astype(t.dtype))
        elif t.dtype.startswith("int"):
            arrays.append(rng.integers(t.low, high, size=shape, dtype=t.dtype))
        elif high is not None:
            arrays.append(rng.uniform(0, high, size=shape).astype(t.dtype))
        else:
            arrays.append(rng.standard_normal(shape, dtype=np.float32).astype(t.dtype))
    return arrays


def _dynamic_shapes(spec: SubmoduleSpec, dynamic: set[str]) -> tuple:
    # Dim.AUTO lets torch.export infer the relations (even latent sides, ...); the symbols it
    # picks are renamed to our dimension names afterwards.
    return tuple({i: torch.export.Dim.AUTO for i, d in enumerate(t.shape) if d in dynamic} for t in spec.inputs)


def _grouped(module: torch.nn.Module, shapes: tuple) -> tuple:
    """The shapes as torch.export matches them to forward's parameters: those a `*args` takes (TypedIO's
    inputs, a UNet's ControlNet residuals) as one tuple."""
    params = inspect.signature(module.forward).parameters.values()
    named = sum(p.kind == p.POSITIONAL_OR_KEYWORD for p in params)
    if not any(p.kind == p.VAR_POSITIONAL for p in params) or len(shapes) == named:
        return shapes
    return (*shapes[:named], tuple(shapes[named:]))


def _name_axes(model, spec: SubmoduleSpec, dynamic: set[str]) -> None:
    """Give graph inputs/outputs our dimension names, and rename the exporter's symbols
    (s0, s12, 2*((s12//2)) ...) everywhere else, so every stage sees 'batch', 'latent_height'."""
    import onnx_ir as ir

    symbols: dict[str, str] = {}
    for value, t in zip(model.graph.inputs, spec.inputs):
        for dim, name in zip(value.shape, t.shape):
            if isinstance(name, str) and name in dynamic and isinstance(dim, ir.SymbolicDim) and dim.value:
                symbols.setdefault(dim.value, name)
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, symbols)) + r")\b") if symbols else None

    def rename(shape):
        if shape is None or pattern is None:
            return shape
        return ir.Shape([ir.SymbolicDim(pattern.sub(lambda m: symbols[m.group(1)], d.value))
                         if isinstance(d, ir.SymbolicDim) and d.value else d for d in shape])

    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for value in node.outputs:
            value.shape = rename(value.shape)
    for values, specs in ((model.graph.inputs, spec.inputs), (model.graph.outputs, spec.outputs)):
        for value, t in zip(values, specs):
            value.shape = ir.Shape([d if isinstance(d, int) else (d if d in dynamic else old)
                                    for d, old in zip(t.shape, value.shape)])


def trace(spec: SubmoduleSpec, module: torch.nn.Module, constants: dict, dynamic: set[str], probe: dict,
          opset: int = DEFAULT_OPSET, optimize: bool = True):
    """torch.onnx.export (dynamo) of `module` at the `probe` shape, axes named; the ONNXProgram."""
    example = [torch.from_numpy(a) for a in example_inputs(spec, probe, constants, seed=0)]
    shapes = _grouped(module, _dynamic_shapes(spec, dynamic))
    # Without the fake tensor cache: with symbolic sizes its entries cost more to make and to read than the
    # operators' meta functions they save (z-image-tiny's export 15.5 -> 13.0 s on one core; the same graphs).
    with torch.no_grad(), lowering.lowered_in_place(), torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
        program = torch.onnx.export(
            module, tuple(example), dynamo=True, opset_version=opset, optimize=optimize,
            input_names=[t.name for t in spec.inputs], output_names=[t.name for t in spec.outputs],
            dynamic_shapes=shapes, verbose=False,
        )
    _name_axes(program.model, spec, dynamic)
    return program


CACHED = "trace cache"  # SharedTraces.maker of a trace an earlier export stored


class SharedTraces:
    """The traces an export's graphs share, each kept until the last graph of the export that takes it has: the
    graphs cut from one trace (`SubmoduleSpec.cut_from`), and the graphs of components of one architecture (Wan 2.2
    A14B's two transformers), whose traces before their weights are the same. `keys`: {graph name: what its trace
    depends on} (export.api's `_trace_key`). With `cache`, a trace is taken from it where an earlier export stored
    one of the key, and stored there once made."""

    def __init__(self, keys: dict[str, str], cache: TraceCache | None = None):
        self._keys, self._cache = keys, cache
        self._left = collections.Counter(keys.values())
        self._models = {}
        self._makers = {}  # trace key -> the graph that traced it, or CACHED

    def take(self, spec: SubmoduleSpec, make):
        key = self._keys[spec.name]
        model = self._models.pop(key, None)
        if model is None:
            model = self._cache.load(key) if self._cache else None
            self._makers[key] = CACHED
        if model is None:
            model, self._makers[key] = make(), spec.name
            if self._cache:
                weightless(model)
                self._cache.store(key, model)
        self._left[key] -= 1
        if self._left[key] > 0:
            self._models[key] = model
            return model.clone()
        return model

    def skip(self, spec: SubmoduleSpec) -> None:
        """`spec`'s graph is not traced (an earlier export's is linked): a trace is not kept for it."""
        key = self._keys[spec.name]
        self._left[key] -= 1
        if self._left[key] == 0:
            self._models.pop(key, None)

    def maker(self, spec: SubmoduleSpec) -> str | None:
        """The graph whose trace `spec`'s graph was made from (CACHED: an earlier export's), if not its own."""
        maker = self._makers.get(self._keys[spec.name])
        return maker if maker != spec.name else None


def traced_graph(spec: SubmoduleSpec, component, dtype: str, constants: dict, dynamic: set[str], probe: dict,
                 opset: int = DEFAULT_OPSET, traces: SharedTraces | None = None):
    """(`spec`'s graph traced from `component`, not yet optimized; the module traced): its own trace, or the one it
    shares (`traces`: made by an earlier graph of the export), cut to it where it is cut from a trace
    (`spec.cut_from`)."""
    shared, cut = spec.cut_from or (spec, None)
    module = wrapped(shared, component, dtype)
    make = lambda: trace(shared, module, constants, dynamic, probe, opset, optimize=False).model  # noqa: E731
    model = traces.take(spec, make) if traces is not None else make()
    if cut is not None:
        cut(model, spec)
    return model, module


def export_weightless(spec: SubmoduleSpec, src, dtype: str, constants: dict, dynamic: set[str], probe: dict,
                      opset: int = DEFAULT_OPSET, traces: SharedTraces | None = None):
    """The submodule's graph traced without weights, then given them from the checkpoint (still
    on disk: they are read when the graph is written). Returns (onnx-ir model, the weights'
    provenance, counts)."""
    component = weightless_component(src, spec.component, dtype, **spec.load_kwargs)
    model, module = traced_graph(spec, component, dtype, constants, dynamic, probe, opset, traces)
    table = WeightTable()
    index = checkpoint_index(src.folder / spec.component)
    counts = attach_weights(model, module, index, spec.component, table, loaded_names(component, index))
    counts["transposes_deferred"] = defer_weight_transposes(model, table)
    table.reconcile(initializer_types(model))  # the transposed weights' sources are gone
    small = {name: model.graph.initializers[name].const_value for name, r in table.items()
             if np.prod(r["shape"]) <= MERGED_SIZE_LIMIT}
    optimize(model)
    counts["parameters_merged"] = _record_merged(table, small, model)
    counts.update(table.reconcile(initializer_types(model)))
    # What the wrapper cut from the component (an LLM encoder's layers past the deepest read): the report's
    model.meta["export_notes"] = getattr(getattr(module, "wrapper", module), "export_notes", None)
    return model, table, counts


# onnxscript's rewrite rules that the export's optimizer skips. SlicesSplit has two output nodes, and
# onnxscript matches such patterns by walking the whole graph for every node: quadratic, 34 s of the
# sd15-tiny U-Net's 136 s export, for a rule that rewrites nothing in our families' graphs
# (test_lazy_export compares our graphs with those of the exporter's full optimizer).
SKIPPED_REWRITE_RULES = ("SlicesSplit",)


class _RootChecked:
    """A rewrite rule of one output node tried only on nodes of that node's operator. onnxscript tries every rule
    on every node, and its matcher's first check is that operator: the same rewrites, without 40-odd matcher
    calls a node (half the optimizer's time: 1.9 -> 1.0 s over z-image-tiny's five graphs)."""

    def __init__(self, rule):
        pattern = rule._target_pattern
        self._rule, self._op = rule, pattern.output_node.op if pattern.has_single_output_node else None

    def __getattr__(self, name):
        return getattr(self._rule, name)

    def try_rewrite(self, model, graph, node, **options):
        if self._op is not None and not self._op.matches(node.op_type):
            return None
        return self._rule.try_rewrite(model, graph, node, **options)


def optimize(model) -> None:
    """The exporter's own optimizer on `model`, in place, as torch.onnx.export(optimize=True) runs it (onnxscript's
    constant folding, rewrite rules and fusions), less SKIPPED_REWRITE_RULES, each rule tried on its operator's
    nodes only (`_RootChecked`). onnxscript's optimizer takes no rule list: its default list is replaced for this
    call only."""
    from unittest import mock

    from onnxscript import rewriter

    kept = tuple(_RootChecked(r) for r in rewriter._DEFAULT_REWRITE_RULES
                 if getattr(r, "name", None) not in SKIPPED_REWRITE_RULES)
    with mock.patch.object(rewriter, "_DEFAULT_REWRITE_RULES", kept):
        torch.onnx.ONNXProgram(model, None).optimize()


MERGED_SIZE_LIMIT = 1024  # onnx-ir's DeduplicateInitializersPass (run by the optimizer) merges up to this size


def _record_merged(table, small: dict, model) -> int:
    """The optimizer merges bitwise-equal small initializers into one (zero biases, unit norm
    scales): record a merged parameter as a further part of the initializer it now shares, so a
    change to one of them alone is refused instead of lost. Returns how many were merged."""
    kept = {}
    for name, value in model.graph.initializers.items():
        if name in table and value.const_value is not None and value.const_value.size <= MERGED_SIZE_LIMIT:
            t = value.const_value
            kept[(t.dtype, tuple(t.shape), t.tobytes())] = name
    merged = 0
    for name, tensor in small.items():
        if name in model.graph.initializers:
            continue
        into = kept.get((tensor.dtype, tuple(tensor.shape), tensor.tobytes()))
        if into is not None:
            table[into]["parts"] += table[name]["parts"]
            merged += 1
    return merged


def export_submodule(spec: SubmoduleSpec, src, dtype: str, constants: dict, dynamic: set[str],
                     probes: list[dict], out_path: Path, opset: int = DEFAULT_OPSET,
                     traces: SharedTraces | None = None) -> dict:
    """Export `spec`'s component of `src` with `dtype` weights to `out_path` and check it against
    PyTorch; returns the report. `traces`: the export's shared traces (`SharedTraces`)."""
    t0 = time.perf_counter()
    model, table, counts = export_weightless(spec, src, dtype, constants, dynamic, probes[0], opset, traces)
    files = save_graph(model, out_path)
    table.save(table_path(out_path))
    notes = model.meta["export_notes"]
    del model
    _collect(src, spec)  # the graph's nodes and values refer to each other: free it (and its maps) now
    export_seconds = time.perf_counter() - t0
    parity = check_parity(spec, src, dtype, constants, probes, out_path)
    bad = [p for p in parity if not p.ok]
    if bad:
        raise ExportParityError(
            f"{spec.name}: ONNX Runtime differs from PyTorch by {bad[0].max_abs_err:.3g} at {bad[0].dims} "
            f"(allowed {bad[0].rtol:g} x max(1, |reference| = {bad[0].max_abs_ref:.3g}))"
        )
    return {
        "export_seconds": round(export_seconds, 2),
        "bytes": sum((out_path.parent / f).stat().st_size for f in files),
        "opset": opset,
        "dtype": dtype,
        "weights": counts,
        **({"graph": notes} if notes else {}),
        "parity": [{"dims": p.dims, "max_abs_err": p.max_abs_err, "max_abs_ref": p.max_abs_ref} for p in parity],
    }


# Weights above which an export frees a graph's or a reference's reference cycles at once: a collection takes
# about half a second in an exporting process, which a tiny model's graphs (a few MiB) would pay for nothing.
COLLECT_MIN_BYTES = 256 << 20


def _collect(src, spec: SubmoduleSpec) -> None:
    if sum(t["length"] for t in checkpoint_index(src.folder / spec.component).values()) > COLLECT_MIN_BYTES:
        gc.collect()


# Weights above which the parity check holds no component whole (export/streamed_parity.py): the
# reference and then ONNX Runtime would each hold them once, next to the process's other memory.
WHOLE_PARITY_MAX_BYTES = 8 << 30


def check_parity(spec, src, dtype, constants, probes, onnx_path,
                 whole_max_bytes: int = WHOLE_PARITY_MAX_BYTES, segment_bytes: int | None = None) -> list[ParityResult]:
    """PyTorch against ONNX Runtime at each probe; the references are computed and freed before the
    session opens.

    The reference of an fp32 export is the component from_pretrained. That of an fp16 export is the
    component computed in fp32 over the export's weights (each rounded to the dtype the graph holds it
    in): ONNX Runtime's CPU kernels compute fp16 graphs in fp32 behind casts (and drop a cast pair
    where one meets its inverse), so an fp16 reference would differ from them by its own rounding,
    not by the graph's. It reads one module's weights at a time, as does a component over
    `whole_max_bytes`, whose graph ONNX Runtime then runs in segments."""
    from export import streamed_parity

    feeds = [example_inputs(spec, dims, constants, seed=100 + i) for i, dims in enumerate(probes)]
    weights = sum(t["length"] for t in checkpoint_index(src.folder / spec.component).values())
    streamed = weights > whole_max_bytes
    if streamed or dtype != "float32":
        refs = streamed_parity.streamed_reference(spec, src, dtype, feeds)
    else:
        module = wrapped(spec, src.load(spec.component, **spec.load_kwargs).eval())
        with torch.no_grad():
            refs = [[r.numpy() for r in module(*[torch.from_numpy(a) for a in inputs])] for inputs in feeds]
        del module
    _collect(src, spec)
    named = [{t.name: a for t, a in zip(spec.inputs, inputs)} for inputs in feeds]
    options = _parity_session_options()
    if streamed:
        outputs = streamed_parity.segmented_outputs(onnx_path, named, options,
                                                    segment_bytes or streamed_parity.SEGMENT_BYTES)
    else:
        import onnxruntime as ort

        session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
        outputs = [session.run(None, feed) for feed in named]
    results = []
    for dims, got, ref in zip(probes, outputs, refs):
        err = max(float(np.max(np.abs(g - r))) for g, r in zip(got, ref))
        scale = max(float(np.max(np.abs(r))) for r in ref)
        used = {k: v for k, v in dims.items() if any(k in t.shape for t in spec.inputs + spec.outputs)}
        results.append(ParityResult(used, err, scale, PARITY_RTOL[dtype]))
    return results


def _parity_session_options():
    import onnxruntime as ort

    options = ort.SessionOptions()
    # ONNX Runtime's CPU kernels run fp16 MatMuls in fp32 behind Casts of the weights. At the full
    # optimization level those Casts are folded: fp32 copies of all the weights at once. At the
    # basic level each is cast when run, and without the arena each copy is freed after its use;
    # the priority-based order runs the casts nearer their use (T5-XXL: fewer layers' copies alive).
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.enable_cpu_mem_arena = False
    options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    options.intra_op_num_threads = cpu_threads(None) or 0
    return options
