"""A CPU stand-in for polygraphy's TrtRunner, where it matters to the pipeline: every call returns
views of one host buffer per output, refilled on the next call (and poisoned with NaN when a larger
output makes it reallocate, as `resize(refcheck=False)` may move it), and a TensorRT artifact's
engines accept only the shapes of their optimization profile. It runs the ONNX Runtime artifact's
graph of the same submodule, so its images must equal ONNX Runtime's exactly."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import runners.pipeline
from runners.backends import get_backend, open_session


class SharedBufferSession:
    def __init__(self, inner, profile: dict | None = None):
        self.inner, self.profile = inner, profile
        self.buffers: dict[str, np.ndarray] = {}
        self.calls = 0
        self.closed = False

    def run(self, feeds: dict[str, np.ndarray], release: bool = False) -> dict[str, np.ndarray]:
        assert not self.closed, "a closed session was run"
        for name, array in (feeds.items() if self.profile else ()):
            lo, hi = self.profile[name]["min"], self.profile[name]["max"]
            if not all(a <= d <= b for a, d, b in zip(lo, array.shape, hi)):  # TensorRT's set_input_shape fails
                raise RuntimeError(f"set_input_shape({name}, {array.shape}) is outside the profile {lo}..{hi}")
        self.calls += 1
        outputs = {}
        for name, result in self.inner.run(feeds, release).items():
            buffer = self.buffers.get(name)
            if buffer is None or buffer.nbytes < result.nbytes:
                if buffer is not None:
                    buffer.fill(0xFF)  # the old memory is gone: float views of it read NaN
                buffer = self.buffers[name] = np.empty(result.nbytes, np.uint8)
            view = buffer[: result.nbytes].view(result.dtype).reshape(result.shape)
            view[...] = result
            outputs[name] = view
        return outputs

    def close(self) -> None:
        self.closed = True
        self.inner.close()


class SharedBuffers:
    """Installed with `install(monkeypatch, ort_artifact)`: every session the pipeline opens is a
    SharedBufferSession. An ONNX Runtime artifact's engines run as they are; a TensorRT artifact's run
    `ort_artifact`'s graph of the same submodule, held to the TensorRT engine's profile."""

    def __init__(self, ort_artifact: Path):
        self.ort_artifact = Path(ort_artifact)
        self.opened: list[SharedBufferSession] = []

    def open(self, backend, path, device=None, **options):
        path = Path(path)
        profile = None
        if get_backend(backend).gpu:
            name = path.name.split(".trt")[0]
            profile = json.loads((path.parent / "manifest.json").read_text())["submodules"][name]["engine"]["profile"]
            backend, path, device = "ort", self.ort_artifact / f"{name}.onnx", None
            options = {k: v for k, v in options.items() if k in ("threads", "profile")}
        session = SharedBufferSession(open_session(backend, path, device=device, **options), profile)
        self.opened.append(session)
        return session

    @property
    def live(self) -> int:
        return sum(not s.closed for s in self.opened)

    @classmethod
    def install(cls, monkeypatch, ort_artifact) -> "SharedBuffers":
        double = cls(ort_artifact)
        monkeypatch.setattr(runners.pipeline, "open_session", double.open)
        return double
