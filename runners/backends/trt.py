"""TensorRT and TensorRT-RTX engines, run by polygraphy's TrtRunner: no torch. The runner sets the
input shapes of every call and keeps its device buffers across calls (they grow when a call needs
more), so the denoising loop allocates nothing after its first step. A session is pinned to one
GPU (cuda-python's cudaSetDevice), which is how a device map spreads a pipeline over several."""
from __future__ import annotations

import shutil
import subprocess

import numpy as np


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


def use_tensorrt(rtx: bool):
    """Point polygraphy at TensorRT-RTX or TensorRT proper, and return that module."""
    import polygraphy.config

    polygraphy.config.USE_TENSORRT_RTX = rtx
    if rtx:
        import tensorrt_rtx as trt
    else:
        import tensorrt as trt
    return trt


class TrtSession:
    def __init__(self, path, rtx: bool, device: int = 0, **_ort_only_options):
        gpus = gpu_count()
        if gpus == 0:
            raise RuntimeError(f"{path} is a TensorRT engine: it runs on an NVIDIA GPU, and this machine has none. "
                               "Build the artifact with --target ort to run it here.")
        if not 0 <= device < gpus:
            raise ValueError(f"{path}: device {device} does not exist; this machine has GPUs 0 to {gpus - 1}")
        from cuda.bindings import runtime
        from polygraphy.backend.common import BytesFromPath

        use_tensorrt(rtx)
        from polygraphy.backend.trt import EngineFromBytes, TrtRunner

        self._set_device = lambda: runtime.cudaSetDevice(device)
        self._set_device()
        self.runner = TrtRunner(EngineFromBytes(BytesFromPath(str(path))))
        self.runner.activate()

    def run(self, feeds: dict[str, np.ndarray], release: bool = False) -> dict[str, np.ndarray]:
        self._set_device()
        return dict(self.runner.infer(feeds))
