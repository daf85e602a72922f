"""A CPU stand-in for polygraphy's TrtRunner, where it matters to the pipeline: every call returns
views of one host buffer per output, refilled on the next call (and poisoned with NaN when a larger
output makes it reallocate, as `resize(refcheck=False)` may move it), and a TensorRT artifact's
engines accept only the shapes of their optimization profile and refit as TensorRT's Refitter does.
It runs the ONNX Runtime artifact's graph of the same submodule, so its images must equal ONNX
Runtime's exactly."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import runners.pipeline
from runners.backends import get_backend, open_session
from runners.adapters.provenance import WeightTable


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


class RefitSession(SharedBufferSession):
    """A TensorRT engine's stand-in with TensorRT's refit contract: only the weights its build marked
    refittable (those with values kept beside the engine), each at its recorded dtype and shape; a
    refitted value stays until refitted again. The ONNX Runtime graph runs with every refitted value."""

    def __init__(self, reopen, profile: dict, refittable: dict, initializers: dict | None):
        self.reopen, self.refittable, self.weights = reopen, refittable, {}
        super().__init__(reopen({}), profile)
        if initializers:
            self.refit(initializers)

    def refit(self, weights: dict[str, np.ndarray]) -> None:
        if not self.refittable:
            raise ValueError("this engine was built without --refittable")
        for name, values in weights.items():
            record = self.refittable.get(name)
            assert record is not None, f"{name} is not a refittable weight of this engine"
            assert (values.dtype.name, list(values.shape)) == (record["dtype"], record["shape"]), name
        self.weights.update(weights)
        self.inner.close()
        self.inner = self.reopen(dict(self.weights))


class SharedBuffers:
    """Installed with `install(monkeypatch, ort_artifact)`: every session the pipeline opens is a
    SharedBufferSession. An ONNX Runtime artifact's engines run as they are; a TensorRT artifact's run
    `ort_artifact`'s graph of the same submodule, held to the TensorRT engine's profile."""

    def __init__(self, ort_artifact: Path):
        self.ort_artifact = Path(ort_artifact)
        self.opened: list[SharedBufferSession] = []

    def open(self, backend, path, device=None, **options):
        path = Path(path)
        if get_backend(backend).gpu:
            name = path.name.split(".trt")[0]
            sub = json.loads((path.parent / "manifest.json").read_text())["submodules"][name]
            table = WeightTable.load(path.parent / sub["weights_file"]) if sub.get("weights_file") else {}
            refittable = {n: r for n, r in table.items() if r.get("location", {}).get("file", "").endswith(".refit.data")}
            kept = {k: v for k, v in options.items() if k in ("threads", "profile")}
            session = RefitSession(lambda weights: open_session("ort", self.ort_artifact / f"{name}.onnx",
                                                                initializers=weights, **kept),
                                   sub["engine"]["profile"], refittable, options.get("initializers"))
        else:
            session = SharedBufferSession(open_session(backend, path, device=device, **options))
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
