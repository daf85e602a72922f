"""ONNX Runtime sessions. A requested provider that ONNX Runtime silently drops (onnxruntime-gpu
without CUDA falls back to the CPU) is an error here, never a quiet fallback."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from runners.backends import Backend, cpu_threads
from runners.adapters.quantized import FLOAT8_E4M3FN

FLOAT8E4M3FN = 17  # onnx.TensorProto.FLOAT8E4M3FN (the runner does not import onnx)


def session_settings(options, config: dict[str, str] | None, settings: dict | None) -> dict:
    """Apply an artifact's session config entries and session options (execution_order,
    enable_cpu_mem_arena, enable_mem_reuse, disabled_optimizers) to ONNX Runtime `options`;
    returns the InferenceSession keyword arguments they need."""
    import onnxruntime as ort

    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    settings = dict(settings or {})
    if "execution_order" in settings:
        options.execution_order = getattr(ort.ExecutionOrder, settings.pop("execution_order"))
    disabled = settings.pop("disabled_optimizers", None)
    for key, value in settings.items():
        if key not in ("enable_cpu_mem_arena", "enable_mem_reuse"):
            raise ValueError(f"unknown ONNX Runtime session option '{key}' in the manifest")
        setattr(options, key, value)
    return {"disabled_optimizers": disabled} if disabled else {}


class OrtSession:
    def __init__(self, path, threads: int | None = None, providers: list[str] | None = None,
                 profile: bool = False, session_config: dict[str, str] | None = None,
                 session_options: dict | None = None, initializers: dict[str, np.ndarray] | None = None):
        """`session_config` and `session_options`: what the artifact's manifest asks of ONNX Runtime
        (fp8 graphs need `session.disable_quant_qdq` on onnxruntime before 1.32, whose QDQ fusions
        are int8 only; graphs whose memory passes ran need their node order kept, see
        `session_settings`). `initializers` replace the graph's weights of those names (adapted by
        a LoRA, runners/adapters/lora.py): ONNX Runtime takes them before it optimizes the graph."""
        import onnxruntime as ort

        options = ort.SessionOptions()
        if profile:  # ONNX Runtime's per-operator profile of every run, read back by `end_profiling`
            self._profile_dir = tempfile.TemporaryDirectory(prefix="ort-profile-")
            options.enable_profiling = True
            options.profile_file_prefix = os.path.join(self._profile_dir.name, Path(path).stem)
        # The memory pattern plans one block per input shape and keeps it beside the arena's buffers
        # from the first run: with dynamic shapes a second run holds the working memory twice, at no
        # gain in speed (the peak RSS columns of BENCHMARKS.md are measured with it off).
        options.enable_mem_pattern = False
        extra = session_settings(options, session_config, session_options)
        initializers = initializers or {}
        # The session reads these buffers for as long as it lives: they are kept with it.
        self._initializers = [_ortvalue(v) for v in initializers.values()]
        for name, value in zip(initializers, self._initializers):
            options.add_initializer(name, value)
        if any(v.ndim >= 3 for v in initializers.values()):
            # onnxruntime 1.32's NCHWc layout transformer (CPU, full optimization level) reorders a
            # convolution's kernel from the graph's own tensor, not the one given here: the override
            # is lost without a word (measured on sd15-tiny's 1x1 proj_in Convs). Matrix weights
            # (2-D) are not affected, and keep every optimization.
            extra["disabled_optimizers"] = [*extra.get("disabled_optimizers", []), "NchwcTransformer"]
        if any(v.dtype != np.float32 for v in initializers.values()):
            # Likewise, above the layout level (ORT_ENABLE_ALL) onnxruntime 1.32 computes fp16 weights'
            # float32 copies for its CPU kernels from the graph's own tensors (sd3-tiny's fp16 transformer:
            # the adapter's change was lost entirely). The layout level keeps the overrides.
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_LAYOUT
        if any(v.dtype == FLOAT8_E4M3FN for v in initializers.values()):
            # And constant folding turns an fp8 weight's DequantizeLinear into float32 from the graph's own
            # codes (sd3-tiny's fp8 transformer with an adapter: 26.8 dB against fp32 with it, 37.6 without
            # the fold, as the artifact written with the adapter gives).
            extra["disabled_optimizers"] = [*extra.get("disabled_optimizers", []), "ConstantFolding"]
        threads = cpu_threads(threads)
        if threads:
            options.intra_op_num_threads = threads
        providers = list(providers or ["CPUExecutionProvider"])
        available = ort.get_available_providers()
        missing = [p for p in providers if p not in available]
        if missing:
            raise RuntimeError(f"ONNX Runtime providers not available: {', '.join(missing)} "
                               f"(available: {', '.join(available)})")
        self.session = ort.InferenceSession(str(path), options, providers=providers, **extra)
        dropped = [p for p in providers if p not in self.session.get_providers()]
        if dropped:
            raise RuntimeError(f"{path}: ONNX Runtime could not start {', '.join(dropped)} "
                               f"(it would have run on {self.session.get_providers()}); check the CUDA install")
        self.output_names = [o.name for o in self.session.get_outputs()]
        # Hands the arena's buffers back after a call, so that a pipeline of several engines holds
        # the working memory of one stage at a time, not the sum of all of them (without it the
        # transformer's arena stays at its peak through the VAE decode).
        self._release = None
        if options.enable_cpu_mem_arena:  # without the arena, freed buffers go back at once
            self._release = ort.RunOptions()
            self._release.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")

    def end_profiling(self) -> list[dict]:
        """The trace events ONNX Runtime recorded since the session opened (profiling sessions only)."""
        path = Path(self.session.end_profiling())
        events = json.loads(path.read_text())
        self._profile_dir.cleanup()
        return events

    def close(self) -> None:
        self.session = None  # ONNX Runtime frees the session's weights and arena with its last reference

    def run(self, feeds: dict[str, np.ndarray], release: bool = False) -> dict[str, np.ndarray]:
        """`release=True` on a stage's last call frees the working memory it leaves behind."""
        outputs = self.session.run(self.output_names, feeds, self._release if release else None)
        return dict(zip(self.output_names, outputs))


def _ortvalue(array: np.ndarray):
    """`array` as an OrtValue; fp8 bytes (runners.adapters.quantized.FLOAT8_E4M3FN) as ONNX's float8e4m3fn."""
    import onnxruntime as ort

    array = np.ascontiguousarray(array)
    if array.dtype == FLOAT8_E4M3FN:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint8), FLOAT8E4M3FN)
    return ort.OrtValue.ortvalue_from_numpy(array)


def _open(path, device=None, **options) -> OrtSession:
    return OrtSession(path, **options)


BACKENDS = [Backend("ort", "ONNX Runtime", _open, threads=True, adapters=True, concurrent=True,
                    triton='backend: "onnxruntime"',
                    device_hint=" (choose its GPU with ONNX Runtime's provider options)")]
