"""Traces kept across exports, keyed by architecture: a graph traced before its weights are attached is the same for
every checkpoint of one class and configuration. A fine-tune of a model exported before, a second ControlNet of one
configuration, Wan 2.2's second transformer after Wan 2.1's: each takes the trace and gives it its own weights.

A trace is stored as an ONNX file without weights: each parameter's initializer is a placeholder of its dtype and
shape (`weightless`), which the export replaces by the checkpoint's tensor (`lazy_weights.attach_weights`); the
buffers the module's constructor made are stored as they are. The key names the code that traces (this package's
modules, by content) and the libraries' versions, so a change to either traces anew.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import onnx_ir as ir

from runners.manifest import digest

PLACEHOLDER = "weights-not-stored"  # the placeholders' file: reading one (a weight never attached) fails


def weightless(model: ir.Model) -> None:
    """The trace's parameters (the exporter's fake tensors) as placeholders of their dtype and shape, in place."""
    from torch._subclasses.fake_tensor import FakeTensor

    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(getattr(tensor, "raw", None), FakeTensor):
            value.const_value = ir.ExternalTensor(PLACEHOLDER, 0, tensor.nbytes, tensor.dtype, shape=tensor.shape,
                                                  name=value.name)


def _code() -> str:
    """The export package's code, by content (the families' wrappers, the exporter's settings and passes)."""
    here = Path(__file__).parent
    return digest([(p.relative_to(here).as_posix(), p.read_text()) for p in sorted(here.rglob("*.py"))])


class TraceCache:
    """Traces in `root`, one file each, by key (export.api's `_trace_key`)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._code = _code()

    def _path(self, key: str) -> Path:
        return self.root / f"{digest([key, self._code])}.onnx"

    def load(self, key: str) -> ir.Model | None:
        path = self._path(key)
        return ir.load(path) if path.exists() else None

    def store(self, key: str, model: ir.Model) -> None:
        """Written whole or not at all (a file of another process's export of the same key is the same). A cache
        that cannot be written (a full disk, a read-only folder) is not the export's failure: the next export of
        the architecture traces it again."""
        tmp = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
            os.close(fd)
            ir.save(model, tmp)
            os.replace(tmp, self._path(key))
        except OSError:
            pass
        finally:
            if tmp:
                Path(tmp).unlink(missing_ok=True)
