"""TensorRT targets, built through polygraphy's TensorRT loaders: `trt-rtx` (TensorRT for RTX,
which builds real engines on a machine without a GPU) and `trt` (TensorRT proper, for servers,
which needs one). One code path serves both: polygraphy imports `tensorrt_rtx` or `tensorrt`
according to its USE_TENSORRT_RTX setting.

Networks are strongly typed: the graph's types decide the precision (fp16, bf16 and fp8 come from
the precision passes), so there are no precision flags. Each input gets one optimization profile from
the manifest's min/opt/max ranges, or one fixed shape with `static`. Engines are cached by a hash
of the graph, the build settings and the TensorRT version, and TensorRT's timing cache is kept
across builds, both in the options' cache folder (TensorRT-RTX has no timing cache: it picks its
kernels on the GPU when the engine first runs). The version is in the engine's file name, as in
TensorRT's demo/Diffusion.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from engines.targets import BuildInput, BuildOptions, SubmoduleBuildFailed, Target, TargetError
from runners.backends.trt import gpu_count, use_tensorrt
from runners.manifest import digest, sha256_file

# TensorRT fuses attention itself and cannot parse ONNX Runtime's MultiHeadAttention.
PASSES = ("fold_constants", "infer_shapes", "remove_dead_nodes", "fuse_qkv")
DEFAULT_RTX_CAPABILITIES = ("SM89",)  # Ada: the first RTX generation with fp8


def _log(msg: str) -> None:
    print(f"[engines] {msg}", flush=True)


def _capabilities(trt, rtx: bool, names) -> list[str]:
    """The compute capabilities to build for, checked against what this TensorRT-RTX knows. A bad
    value is the user's error, never a reason to fall back to ONNX Runtime."""
    if not rtx:
        if names:
            raise TargetError("--compute-capability is a TensorRT-RTX setting: TensorRT builds for the GPU it runs on")
        return []
    names = [n.upper() for n in names or DEFAULT_RTX_CAPABILITIES]
    known = [n for n in dir(trt.ComputeCapability) if n.startswith("SM")]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise TargetError(f"compute capability {', '.join(unknown)} is not one TensorRT-RTX {trt.__version__} "
                          f"builds for; it knows: {', '.join(known)}")
    return names


def _builder(rtx: bool):
    def build_submodule(sub: BuildInput, out_dir: Path, options: BuildOptions) -> tuple[list[str], dict]:
        import onnx_ir as ir

        trt = use_tensorrt(rtx)
        shapes = sub.input_shapes(options.static)
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
                _build_engine(trt, rtx, onnx_path, shapes, capabilities, options, cache, cached, sub.name)
        shutil.copy(cached, out_dir / engine_name)
        return [engine_name], {"engine": {"tensorrt": trt.__version__, "rtx": rtx, "cache_key": key,
                                          "compute_capabilities": capabilities, "static": options.static,
                                          "profile": {n: {"min": s[0], "opt": s[1], "max": s[2]}
                                                      for n, s in shapes.items()}}}

    return build_submodule


def _build_engine(trt, rtx, onnx_path, shapes, capabilities, options, cache, dest, name) -> None:
    from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork, NetworkFromOnnxPath, Profile
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
    # Without a GPU, TensorRT-RTX logs CUDA errors it recovers from; a failed build still raises.
    G_LOGGER.module_severity = G_LOGGER.CRITICAL
    try:
        network = NetworkFromOnnxPath(str(onnx_path), strongly_typed=True)
        engine = EngineBytesFromNetwork(network, config, **timing)()
    except Exception as e:  # polygraphy reports parser and builder errors as one exception type per loader
        raise SubmoduleBuildFailed(f"TensorRT could not build {name}: {type(e).__name__}: {e}") from e
    if engine is None:
        raise SubmoduleBuildFailed(f"TensorRT could not build {name} (the builder returned no engine)")
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_bytes(memoryview(engine))
    tmp.replace(dest)  # the cache never holds half an engine
    _log(f"{name}: engine built in {time.perf_counter() - t0:.1f} s, {dest.stat().st_size / 2**20:.1f} MiB")


def _no_gpu() -> str | None:
    """TensorRT proper builds on the GPU it will run on."""
    if gpu_count() == 0:
        return ("TensorRT builds its engines on an NVIDIA GPU, and this machine has none. "
                "--target trt-rtx builds TensorRT-RTX engines without a GPU")
    return None


TARGETS = [
    Target(name="trt-rtx", backend_module="tensorrt_rtx", backend_distributions=("tensorrt-rtx",),
           install_hint="pip install 'diffusion-aot[trt-rtx]'", precisions=("fp32", "fp16", "bf16", "fp8"), passes=PASSES,
           build_submodule=_builder(rtx=True), build_options=True),
    Target(name="trt", backend_module="tensorrt", backend_distributions=("tensorrt", "tensorrt-cu12", "tensorrt-cu13"),
           install_hint="pip install 'diffusion-aot[trt]' (needs NVIDIA's package index to be reachable)",
           precisions=("fp32", "fp16", "bf16", "fp8"), passes=PASSES, build_submodule=_builder(rtx=False), unavailable=_no_gpu,
           build_options=True),
]
