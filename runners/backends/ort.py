"""ONNX Runtime sessions. A requested provider that ONNX Runtime silently drops (onnxruntime-gpu
without CUDA falls back to the CPU) is an error here, never a quiet fallback."""
from __future__ import annotations

import numpy as np


class OrtSession:
    def __init__(self, path, threads: int | None = None, providers: list[str] | None = None):
        import onnxruntime as ort

        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        providers = list(providers or ["CPUExecutionProvider"])
        available = ort.get_available_providers()
        missing = [p for p in providers if p not in available]
        if missing:
            raise RuntimeError(f"ONNX Runtime providers not available: {', '.join(missing)} "
                               f"(available: {', '.join(available)})")
        self.session = ort.InferenceSession(str(path), options, providers=providers)
        dropped = [p for p in providers if p not in self.session.get_providers()]
        if dropped:
            raise RuntimeError(f"{path}: ONNX Runtime could not start {', '.join(dropped)} "
                               f"(it would have run on {self.session.get_providers()}); check the CUDA install")
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.output_names, self.session.run(self.output_names, feeds)))
