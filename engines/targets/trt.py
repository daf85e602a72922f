"""TensorRT targets, built through polygraphy's TensorRT loaders: `trt-rtx` (TensorRT for RTX,
which builds real engines on a machine without a GPU) and `trt` (TensorRT proper, for servers,
which needs one). One code path serves both: polygraphy imports `tensorrt_rtx` or `tensorrt`
according to its USE_TENSORRT_RTX setting.

Networks are strongly typed: the graph's types decide the precision (fp16, bf16 and fp8 come from
the precision passes), so there are no precision flags. Each input gets one optimization profile from
the manifest's min/opt/max ranges; a `static` build's entry holds one value per dim, the shapes the
runner calls for one request (runners/static.py). Engines are cached by a hash
of the graph, the build settings and the TensorRT version, and TensorRT's timing cache is kept
across builds, both in the options' cache folder (TensorRT-RTX has no timing cache: it picks its
kernels on the GPU when the engine first runs). The version is in the engine's file name, as in
TensorRT's demo/Diffusion.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from engines.targets import (
    BuildInput, EngineBuildError, SubmoduleBuildFailed, Target, TargetError, TargetOptions, folder_suffix,
    sizes_argument,
)
from runners.backends.trt import gpu_capability, gpu_count, use_tensorrt
from runners.manifest import digest, sha256_file
from runners.static import StaticRequest

# TensorRT fuses attention itself: ONNX Runtime's MultiHeadAttention fusion is left out.
PASSES = ("fold_constants", "infer_shapes", "remove_dead_nodes", "fuse_qkv")


@dataclass(frozen=True)
class TrtOptions(TargetOptions):
    """What the TensorRT builders take (both targets: one builder)."""

    title: ClassVar[str] = "TensorRT"

    # One fixed shape per input, those the runner calls for this request (runners/static.py), instead
    # of a min/opt/max profile; None: dynamic shapes.
    static: StaticRequest | None = None
    compute_capabilities: tuple[str, ...] = ()  # TensorRT-RTX: the GPUs to build for ("SM89", ...)
    workspace_mib: int | None = None  # the builder's workspace memory pool limit
    cache_dir: Path | None = None  # engines and the timing cache, reused across builds (not in the cache key)
    # The weights adapters change are refittable (TensorRT's REFIT_INDIVIDUAL: those only), and their
    # values are kept beside each engine: LoRA adapters switch by refitting, without a rebuild.
    refittable: bool = False

    @classmethod
    def add_arguments(cls, group) -> None:
        group.add_argument("--static", action="store_true",
                           help="build one fixed shape per input: those the runner calls for one request (the "
                                "--static-* settings), which is then the only request the artifact runs; the "
                                "fastest engines")
        group.add_argument("--static-size", type=sizes_argument, default=None, metavar="HxW",
                           help="the static request's image size (default: the model's default size)")
        group.add_argument("--static-prompts", type=int, default=1, metavar="N",
                           help="prompts per static request (default 1)")
        group.add_argument("--static-images-per-prompt", type=int, default=1, metavar="N",
                           help="images per prompt of the static request (default 1)")
        group.add_argument("--static-no-guidance", action="store_true",
                           help="the static request runs without classifier-free guidance (guidance_scale <= 1)")
        group.add_argument("--compute-capability", action="append", default=[], metavar="SM89",
                           help="trt-rtx: a GPU generation to build for (repeatable; default: this machine's GPU, "
                                "or every generation TensorRT-RTX builds for on a machine without one)")
        group.add_argument("--workspace-mib", type=int, default=None, help="the builder's workspace memory limit")
        group.add_argument("--engine-cache", type=Path, default=None,
                           help="engines and timing cache kept across builds (default: BUILD_DIR/engine-cache)")
        group.add_argument("--refittable", action="store_true",
                           help="engines whose LoRA-reachable weights can be refitted: adapters apply at run time "
                                "(loras=, set_loras, --lora) without a rebuild; fp32 and fp16")

    @classmethod
    def from_args(cls, args) -> TrtOptions:
        described = (args.static_size, args.static_prompts != 1, args.static_images_per_prompt != 1,
                     args.static_no_guidance)
        if any(described) and not args.static:
            raise TargetError("--static-size, --static-prompts, --static-images-per-prompt and --static-no-guidance "
                              "describe the request of a --static build: add --static")
        if args.static_size and len(args.static_size) != 1:
            raise TargetError("--static-size takes one size (HxW): a static build runs one request")
        static = args.static and StaticRequest(*(args.static_size or [(None, None)])[0], args.static_prompts,
                                               args.static_images_per_prompt, not args.static_no_guidance)
        return cls(static or None, tuple(args.compute_capability), args.workspace_mib, args.engine_cache,
                   args.refittable)

    def settings(self) -> dict:
        return {"static": self.static and self.static.record(), "compute_capabilities": list(self.compute_capabilities),
                "workspace_mib": self.workspace_mib, **({"refittable": True} if self.refittable else {})}

    def resolved(self, build_dir: Path, source: dict, precision: str) -> TrtOptions:
        cache_dir = self.cache_dir or build_dir / "engine-cache"
        if cache_dir.exists() and not cache_dir.is_dir():
            raise TargetError(f"--engine-cache {cache_dir} is a file: give a folder (created if missing)")
        try:
            static = self.static and self.static.resolved(source["pipeline"], source["dims"])
        except ValueError as e:
            raise TargetError(str(e)) from None
        return dataclasses.replace(self, static=static, cache_dir=cache_dir)

    def variant(self) -> str:
        """The request a static build runs and refittable weights name the folder, so that builds for other
        requests sit beside each other: `trt-rtx-fp16-static-512x512-2-prompts-refittable`. The GPU generations,
        the workspace limit and the engine cache say where and how the builder builds, not what the engines
        take: they do not (a machine without a GPU names the generations in every build)."""
        s = self.static
        request = (("static", f"{s.height}x{s.width}", s.prompts != 1 and f"{s.prompts}-prompts",
                    s.images_per_prompt != 1 and f"{s.images_per_prompt}-per-prompt", not s.guidance and "no-guidance")
                   if s else ())
        return folder_suffix(*request, self.refittable and "refittable")

    def entry(self, name: str, entry: dict, source: dict) -> dict:
        """Static: the entry narrowed to one shape per input, the request's dims fixed and every other dim
        at its opt value; `static_shapes` records the shapes, which the runner holds every call to."""
        if not self.static:
            return entry
        dims = self.static.dims(name, source["pipeline"])
        fixed = {d: dims.get(d, values[1]) for d, values in entry["dims"].items()}
        entry = {**entry, "dims": {d: [v, v, v] for d, v in fixed.items()}}
        shapes = BuildInput(None, "", entry, source["constants"]).input_shapes()
        return {**entry, "static_shapes": {name: opt for name, (_, opt, _) in shapes.items()}}

    def record(self) -> dict:
        return {**({"static": self.static.record()} if self.static else {}),
                **({"refittable": True} if self.refittable else {})}


def _log(msg: str) -> None:
    print(f"[engines] {msg}", flush=True)


def _capabilities(trt, rtx: bool, names) -> list[str]:
    """The compute capabilities to build for, checked against what this TensorRT-RTX knows. By
    default this machine's GPU; without a GPU there is no default: which generations an engine can
    target depends on its precision (TensorRT-RTX compiles no fp32 GEMM for Turing, SM75), so the user
    names them. A bad value is the user's error, never a reason to fall back to ONNX Runtime."""
    if not rtx:
        if names:
            raise TargetError("--compute-capability is a TensorRT-RTX setting: TensorRT builds for the GPU it runs on")
        return []
    known = [n for n in dir(trt.ComputeCapability) if n.startswith("SM")]
    here = gpu_capability()
    if not names and here and here not in known:
        raise TargetError(f"this machine's GPU is {here}, which TensorRT-RTX {trt.__version__} does not build for "
                          f"(it knows: {', '.join(known)}); pass --compute-capability for the GPUs that will run it")
    if not names and not here:
        raise TargetError(f"TensorRT-RTX builds for the GPUs that will run the engines, and this machine has none to "
                          f"ask: pass --compute-capability (repeatable; TensorRT-RTX {trt.__version__} knows "
                          f"{', '.join(known)}; SM89 is Ada, the first with fp8)")
    names = [n.upper() for n in names] or [here]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise TargetError(f"compute capability {', '.join(unknown)} is not one TensorRT-RTX {trt.__version__} "
                          f"builds for; it knows: {', '.join(known)}")
    return names


def _builder(rtx: bool):
    def build_submodule(sub: BuildInput, out_dir: Path, options: TrtOptions) -> tuple[list[str], dict]:
        import onnx_ir as ir

        trt = use_tensorrt(rtx)
        refit = _refittable_weights(sub) if options.refittable else []
        shapes = sub.input_shapes()
        capabilities = _capabilities(trt, rtx, options.compute_capabilities)
        settings = {**options.settings(), "compute_capabilities": capabilities, "shapes": shapes}
        engine_name = f"{sub.name}.trt{trt.__version__}.plan"
        cache = Path(options.cache_dir or out_dir / ".trt-cache")
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="onnx-for-trt-", dir=out_dir) as tmp:
            onnx_path = Path(tmp) / f"{sub.name}.onnx"
            ir.save(sub.model, onnx_path, external_data=f"{sub.name}.onnx.data")  # any size: weights beside it
            graph = digest([sha256_file(p) for p in sorted(Path(tmp).iterdir())])
            key = digest([graph, settings, trt.__version__, "rtx" if rtx else "trt"])
            cached = cache / f"{sub.name}-{key}.trt{trt.__version__}.plan"
            if cached.exists():
                _log(f"{sub.name}: engine cache hit ({cached.name}): reusing it")
            else:
                _build_engine(trt, rtx, onnx_path, shapes, capabilities, options, cache, cached, sub.name, refit)
        shutil.copy(cached, out_dir / engine_name)
        files = [engine_name, *([_write_refit_values(sub, refit, out_dir)] if refit else [])]
        return files, {"engine": {"tensorrt": trt.__version__, "rtx": rtx, "cache_key": key,
                                          "compute_capabilities": capabilities, "static": bool(options.static),
                                          **({"refittable_weights": len(refit)} if refit else {}),
                                          "profile": {n: {"min": s[0], "opt": s[1], "max": s[2]}
                                                      for n, s in shapes.items()}}}

    return build_submodule


def _refittable_weights(sub: BuildInput) -> list[str]:
    """The initializers an adapter can change (the Linear and Conv weights of the provenance table,
    runners/adapters/provenance.py): the TensorRT ONNX parser names each engine weight after its initializer, so
    the table is the refit map. Quantized weights are refused: codes and scales would refit as one."""
    if not sub.weights:
        raise TargetError(f"--refittable: {sub.name}'s graph records no weight provenance (exported before adapters "
                          "were supported): export it again")
    quantized = sorted(name for name, record in sub.weights.items() if record.get("quantized") or "scale_of" in record)
    if quantized:
        raise TargetError(f"--refittable builds fp32 and fp16 engines: {sub.name} holds quantized weights "
                          f"({quantized[0]}, ...), whose codes and scales TensorRT cannot refit as one")
    return sorted(name for name, record in sub.weights.items() if len(record["shape"]) >= 2)  # Linear and Conv


def _mark_refittable(network, names: list[str], sub_name: str) -> None:
    """Mark exactly `names` refittable; a name the network has no weights of stops the build, named."""
    unmapped = [n for n in names if not network.mark_weights_refittable(n)]
    if unmapped:
        shown = ", ".join(unmapped[:5]) + (f" and {len(unmapped) - 5} more" if len(unmapped) > 5 else "")
        raise TargetError(f"--refittable: {len(unmapped)} weights of {sub_name} that adapters change are not weights "
                          f"of its TensorRT network, so a refit could not reach them: {shown}")


def _write_refit_values(sub: BuildInput, names: list[str], out_dir: Path) -> str:
    """The refittable weights' values as the engine was built with them, in one file beside it: what
    an adapter's change is added to, and what switching it off refits again. Each record gets its place."""
    file = f"{sub.name}.refit.data"
    offset = 0
    with open(out_dir / file, "wb") as f:
        for name in names:
            data = sub.model.graph.initializers[name].const_value.tobytes()
            f.write(data)
            sub.weights[name]["location"] = {"file": file, "offset": offset, "length": len(data)}
            offset += len(data)
    return file


def _build_engine(trt, rtx, onnx_path, shapes, capabilities, options, cache, dest, name, refit=()) -> None:
    from polygraphy.backend.trt import CreateConfig, NetworkFromOnnxPath, Profile
    from polygraphy.exception import PolygraphyException
    from polygraphy.logger import G_LOGGER

    profile = Profile()
    for input_name, (lo, opt, hi) in shapes.items():
        profile.add(input_name, min=lo, opt=opt, max=hi)
    common = {"profiles": [profile]}
    timing = {}
    if not rtx:  # TensorRT-RTX picks its kernels on the GPU at run time: its timing cache is a no-op
        common["load_timing_cache"] = str(cache / f"timing.trt{trt.__version__}.cache")
        timing["save_timing_cache"] = common["load_timing_cache"]
    if options.workspace_mib:
        common["memory_pool_limits"] = {trt.MemoryPoolType.WORKSPACE: options.workspace_mib * 2**20}
    if rtx:
        from polygraphy.backend.tensorrt_rtx import CreateConfigRTX

        config = CreateConfigRTX(compute_capabilities=[(int(c[2:-1]), int(c[-1])) for c in capabilities], **common)
    else:
        config = CreateConfig(**common)
    _log(f"{name}: building the TensorRT{'-RTX' if rtx else ''} {trt.__version__} engine "
         f"({'static' if options.static else 'dynamic'} shapes{', ' + ', '.join(capabilities) if capabilities else ''})")
    t0 = time.perf_counter()
    # Without a GPU, TensorRT-RTX logs CUDA errors it recovers from: quiet for the build, then the
    # caller's level again. Errors are read from the builder's error recorder instead.
    with G_LOGGER.verbosity(G_LOGGER.CRITICAL):
        try:
            network = NetworkFromOnnxPath(str(onnx_path), strongly_typed=True)()
        except PolygraphyException as e:  # the ONNX parser rejected a node
            raise SubmoduleBuildFailed(f"TensorRT could not parse {name}: {_parser_errors(trt, onnx_path) or e}") from e
        recorder = _error_recorder(trt)
        network[0].error_recorder = recorder  # the builder's
        if refit:
            _mark_refittable(network[1], refit, name)
            config = _individually_refittable(trt, config)
        engine = _compile(trt, rtx, network, config, timing, bool(refit))
    if engine is None:
        raise _build_error(name, recorder.errors)
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")  # builds in other processes may share the cache
    tmp.write_bytes(memoryview(engine))
    tmp.replace(dest)  # the cache never holds half an engine
    _log(f"{name}: engine built in {time.perf_counter() - t0:.1f} s, {dest.stat().st_size / 2**20:.1f} MiB")


def _compile(trt, rtx: bool, network, config, timing: dict, refittable: bool):
    """The builder's serialized engine of the parsed `network`; None when the builder fails (its error
    recorder says why)."""
    from polygraphy.backend.trt import EngineBytesFromNetwork
    from polygraphy.exception import PolygraphyException

    if refittable and rtx and gpu_count() == 0:
        # Measured with TensorRT-RTX 1.7: every refit flag (REFIT, REFIT_INDIVIDUAL, REFIT_IDENTICAL with
        # STRIP_PLAN) fails in its kernel compiler on a machine without CUDA, where the same graph builds plain.
        raise TargetError(f"TensorRT-RTX {trt.__version__} builds refittable engines only where an NVIDIA GPU is "
                          "present (its kernel compiler needs CUDA for them), and this machine has none: build "
                          "--refittable on the GPU machine (the weights map was checked here)")
    try:
        return EngineBytesFromNetwork(network, config, **timing)()
    except PolygraphyException:
        return None


def _individually_refittable(trt, config):
    """polygraphy's config loader with TensorRT's REFIT_INDIVIDUAL flag set: only the marked weights are
    refittable, and the builder optimizes the rest as in a plain engine."""
    def create(builder, network):
        built = config(builder, network)
        built.set_flag(trt.BuilderFlag.REFIT_INDIVIDUAL)
        return built

    return create


def _parser_errors(trt, onnx_path) -> str:
    """The ONNX parser's errors, each with its node: polygraphy logs them, then raises without them."""
    logger = trt.Logger(trt.Logger.INTERNAL_ERROR)
    builder = trt.Builder(logger)  # each held while the parser runs: TensorRT does not keep them alive
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    parser.parse_from_file(str(onnx_path))
    errors = [parser.get_error(i) for i in range(parser.num_errors)]
    return "; ".join(f"node {e.node_name() or e.node()} ({e.node_operator()}): {e.desc()}" for e in errors)


def _error_recorder(trt):
    """A TensorRT IErrorRecorder that keeps (error code name, description) of every error reported."""
    class Recorder(trt.IErrorRecorder):
        def __init__(self):
            trt.IErrorRecorder.__init__(self)
            self.errors: list[tuple[str, str]] = []

        def report_error(self, code, desc):
            self.errors.append((code.name, desc))
            return False  # not fatal here: the builder returns no engine, and _build_error decides

        def num_errors(self):
            return len(self.errors)

        def get_error_code(self, i):
            return getattr(trt.ErrorCodeTRT, self.errors[i][0])

        def get_error_desc(self, i):
            return self.errors[i][1]

        def has_overflowed(self):
            return False

        def clear(self):
            self.errors.clear()

    return Recorder()


def _build_error(name: str, errors: list[tuple[str, str]]) -> Exception:
    """Why the builder returned no engine, as the error to raise: SubmoduleBuildFailed (which
    `--fallback ort` takes over) only when the builder rejected a node, layer or operation of the graph
    ("Could not find any implementation for node ...", "Cannot compile operation ..."); memory and
    anything else stop the build."""
    said = "; ".join(f"{code}: {desc}" for code, desc in errors) or "no error was reported"
    memory = any(code == "FAILED_ALLOCATION" or "memory" in desc.lower() for code, desc in errors)
    if not memory and any(word in desc.lower() for _, desc in errors for word in ("node", "layer", "operation")):
        return SubmoduleBuildFailed(f"TensorRT could not build {name}: {said}")
    return EngineBuildError(f"TensorRT failed to build {name} for a reason other than its graph ({said}); "
                            "--fallback ort does not hide this")


def _no_gpu() -> str | None:
    """TensorRT proper builds on the GPU it will run on."""
    if gpu_count() == 0:
        return ("TensorRT builds its engines on an NVIDIA GPU, and this machine has none. "
                "--target trt-rtx builds TensorRT-RTX engines without a GPU")
    return None


TARGETS = [
    Target(name="trt-rtx", backend="trt-rtx", backend_module="tensorrt_rtx", backend_distributions=("tensorrt-rtx",),
           install_hint="pip install 'diffusion-aot[trt-rtx]'", precisions=("fp32", "fp16", "bf16", "fp8"), passes=PASSES,
           build_submodule=_builder(rtx=True), options=TrtOptions),
    Target(name="trt", backend="trt", backend_module="tensorrt",
           backend_distributions=("tensorrt", "tensorrt-cu12", "tensorrt-cu13"),
           install_hint="pip install 'diffusion-aot[trt]' (needs NVIDIA's package index to be reachable)",
           precisions=("fp32", "fp16", "bf16", "fp8"), passes=PASSES, build_submodule=_builder(rtx=False),
           options=TrtOptions, unavailable=_no_gpu),
]
