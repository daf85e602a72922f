"""TensorRT and TensorRT-RTX engines, run by polygraphy's TrtRunner: no torch. The runner sets the
input shapes of every call and keeps its device buffers across calls (they grow when a call needs
more), so the denoising loop allocates nothing after its first step. Its outputs are views of host
buffers it refills on the next call (see runners/backends/__init__.py: the pipeline copies what it
keeps). A session is pinned to one GPU (cuda-python's cudaSetDevice), which is how a device map
spreads a pipeline over several."""
from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys

import numpy as np

from runners.backends import Backend

EXTRAS = {True: "trt-rtx", False: "trt"}  # rtx -> the extra that installs its runtime


class MissingRuntime(RuntimeError):
    """A piece of the TensorRT runtime is not installed; the message names the extra that installs it."""


def _need(module: str, what: str, rtx: bool):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingRuntime(f"running TensorRT{'-RTX' if rtx else ''} engines needs {what} (module {module}), which "
                             f"is not installed: pip install 'diffusion-aot[{EXTRAS[rtx]}]'") from None


def cuda_runtime(rtx: bool):
    """cuda-python's runtime bindings (12.6 and later have `cuda.bindings`; the extras pin 13)."""
    return _need("cuda.bindings.runtime", "cuda-python 12.6 or later", rtx)


def _point_polygraphy_at_cudart(rtx: bool) -> None:
    """polygraphy dlopens libcudart from LD_LIBRARY_PATH and a few fixed folders, not where CUDA 13's
    wheel (nvidia-cuda-runtime) puts it: cuda-pathfinder finds it, and its folder goes first."""
    pathfinder = _need("cuda.pathfinder", "cuda-pathfinder (installed with cuda-python)", rtx)
    try:
        lib = pathfinder.load_nvidia_dynamic_lib("cudart")
    except Exception as e:  # DynamicLibNotFoundError, and its kin across pathfinder releases
        raise MissingRuntime(f"running TensorRT{'-RTX' if rtx else ''} engines needs the CUDA runtime library "
                             f"(libcudart), which was not found ({type(e).__name__}): pip install "
                             f"'diffusion-aot[{EXTRAS[rtx]}]' (it brings nvidia-cuda-runtime)") from None
    folder = os.path.dirname(lib.abs_path)
    paths = os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)
    if folder not in paths:
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([folder, *filter(None, paths)])


def gpu_count() -> int:
    """NVIDIA GPUs visible to this process: by the CUDA runtime when cuda-python is installed,
    else by nvidia-smi; 0 on a machine without either."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        if shutil.which("nvidia-smi") is None:
            return 0
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        return listed.stdout.count("GPU ") if listed.returncode == 0 else 0
    err, count = runtime.cudaGetDeviceCount()
    return count if err == runtime.cudaError_t.cudaSuccess else 0


def gpu_capability(device: int = 0) -> str | None:
    """The compute capability of a GPU as TensorRT-RTX names it ("SM89"); None without a GPU."""
    if gpu_count() <= device:
        return None
    from cuda.bindings import runtime

    err, props = runtime.cudaGetDeviceProperties(device)
    _check(runtime, err, f"cudaGetDeviceProperties({device})")
    return f"SM{props.major}{props.minor}"


def _check(runtime, err, call: str) -> None:
    if err != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"{call} failed: {runtime.cudaGetErrorString(err)[1].decode()}")


def use_tensorrt(rtx: bool):
    """Point polygraphy at TensorRT-RTX or TensorRT proper, and return that module. polygraphy binds
    its TensorRT backend to one of them when the backend is first imported, so a process uses one."""
    import polygraphy.config

    name = "TensorRT-RTX" if rtx else "TensorRT"
    if "polygraphy.backend.trt" in sys.modules and polygraphy.config.USE_TENSORRT_RTX != rtx:
        bound = "TensorRT-RTX" if polygraphy.config.USE_TENSORRT_RTX else "TensorRT"
        raise RuntimeError(f"this process already uses {bound} through polygraphy, which binds one TensorRT per "
                           f"process: build or run {name} engines in another process")
    polygraphy.config.USE_TENSORRT_RTX = rtx
    return _need("tensorrt_rtx" if rtx else "tensorrt", name, rtx)


class TrtSession:
    def __init__(self, path, rtx: bool, device: int = 0, providers: list[str] | None = None,
                 initializers: dict[str, np.ndarray] | None = None):
        """`providers` are ONNX Runtime's: a TensorRT engine refuses them rather than ignore them.
        `initializers` ({weight name: values}) are refitted into the engine once it is loaded."""
        if providers:
            raise ValueError(f"{path}: providers choose ONNX Runtime's execution providers; this is a TensorRT "
                             "engine (place it on a GPU with a device map)")
        runtime = cuda_runtime(rtx)  # every piece the extra installs, checked before the GPU is
        _need("polygraphy", "polygraphy", rtx)
        _need("tensorrt_rtx" if rtx else "tensorrt", "TensorRT-RTX" if rtx else "TensorRT", rtx)
        _point_polygraphy_at_cudart(rtx)
        gpus = gpu_count()
        if gpus == 0:
            raise RuntimeError(f"{path} is a TensorRT engine: it runs on an NVIDIA GPU, and this machine has none. "
                               "Build the artifact with --target ort to run it here.")
        if not 0 <= device < gpus:
            raise ValueError(f"{path}: device {device} does not exist; this machine has GPUs 0 to {gpus - 1}")
        from polygraphy.backend.common import BytesFromPath

        self.path, self.trt = path, use_tensorrt(rtx)
        from polygraphy.backend.trt import EngineFromBytes, TrtRunner

        self._set_device = lambda: _check(runtime, runtime.cudaSetDevice(device)[0], f"cudaSetDevice({device})")
        self._set_device()
        self.runner = TrtRunner(EngineFromBytes(BytesFromPath(str(path))))
        self.runner.activate()
        if initializers:
            self.refit(initializers)

    def refit(self, weights: dict[str, np.ndarray]) -> None:
        """Replace the engine's weights `weights` ({name: values}) in place, between two runs: the refit
        of an engine built --refittable (engines/targets/trt.py marks its adapters' weights), whose
        names are its graph's initializers."""
        refit_weights(self.trt, self.runner.engine, weights, self.path)

    def run(self, feeds: dict[str, np.ndarray], release: bool = False) -> dict[str, np.ndarray]:
        """`release` is accepted and does nothing: the runner allocates the engine's activation memory
        once, at its largest profile shape, and keeps it until `close`."""
        self._set_device()
        return dict(self.runner.infer(feeds))

    def close(self) -> None:
        """Free the device buffers, the stream and the engine (polygraphy has no finalizer for them)."""
        if self.runner.is_active:
            self._set_device()
            self.runner.deactivate()


def refit_weights(trt, engine, weights: dict[str, np.ndarray], path) -> None:
    """TensorRT's Refitter on `engine`: every weight set by name, none missing, then one refit."""
    if not engine.refittable:
        raise ValueError(f"{path}: this engine was built without --refittable, so adapters cannot change its weights: "
                         "build it again with python -m engines ... --refittable")
    refitter = trt.Refitter(engine, trt.Logger(trt.Logger.ERROR))
    held = {name: np.ascontiguousarray(values) for name, values in weights.items()}  # alive until the refit
    unknown = [name for name, values in held.items() if not refitter.set_named_weights(name, trt.Weights(values))]
    if unknown:
        raise ValueError(f"{path}: {', '.join(unknown[:5])} are not refittable weights of this engine")
    missing = refitter.get_missing_weights()
    if missing:
        raise RuntimeError(f"{path}: TensorRT asks for {', '.join(missing[:5])} too before it refits")
    if not refitter.refit_cuda_engine():
        raise RuntimeError(f"{path}: TensorRT's refit failed")


def _opener(rtx: bool):
    def open_engine(path, device=None, providers=None, initializers=None, **ignored) -> TrtSession:
        return TrtSession(path, rtx=rtx, device=device or 0, providers=providers, initializers=initializers)

    return open_engine


# Both run their engines as Triton's tensorrt_plan models (TensorRT-RTX engines too).
# They take adapters by refitting (engines built --refittable).
BACKENDS = [Backend(name, "TensorRT", _opener(rtx), gpu=True, adapters=True, triton='platform: "tensorrt_plan"')
            for name, rtx in (("trt", False), ("trt-rtx", True))]
