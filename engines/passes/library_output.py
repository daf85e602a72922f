"""What the libraries under the passes print, kept out of a successful build's output.

polygraphy and onnx-graphsurgeon print through their own loggers (a "colored module is not
installed" notice on first use, a warning for every constant subgraph they chose not to fold),
ONNX Runtime's tools warn on the root logger and through `warnings`. A build that succeeds shows
our progress lines only; `show_library_output(True)` (the engines CLI's `-v`) lets everything
through, and a pass that fails carries what the libraries said in its error (`PassFailed`).
"""
from __future__ import annotations

import contextlib
import io
import logging
import warnings

_SHOWN = False


def show_library_output(shown: bool = True) -> None:
    """Let the libraries print as they run (for `-v`), instead of keeping what they say for a failure."""
    global _SHOWN
    _SHOWN = shown


class _Kept(logging.Handler):
    def __init__(self, stream):
        super().__init__(logging.NOTSET)
        self.stream = stream

    def emit(self, record):
        self.stream.write(f"{record.levelname} {record.name}: {record.getMessage()}\n")


@contextlib.contextmanager
def library_output():
    """Yields a buffer that holds what the libraries printed, logged or warned inside the block,
    instead of the terminal (nothing is held when `show_library_output` is on)."""
    kept = io.StringIO()
    if _SHOWN:
        yield kept
        return
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers[:] = [_Kept(kept)]
    root.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(kept), contextlib.redirect_stderr(kept), warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = lambda message, category, *_: kept.write(f"{category.__name__}: {message}\n")
            yield kept
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
