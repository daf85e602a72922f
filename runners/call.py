"""What one `pipe(...)` call holds while it runs: its cache config and step cache, its previews, the
seconds of its stages and the images its VAE encoded. It lives in the calling thread's context, never on
the pipeline, so that two calls on one pipeline in two threads cannot see each other's (the conditions a
call's steps make are in the `conditions` they return: runners/text_to_image.py). The pipeline's `timings`
and `cache_stats` are the last finished call's."""
from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field


@dataclass
class Call:
    cache_config: object = None  # runners.caches.CacheConfig, or None: every evaluation in full
    previews: object = None  # runners.preview.Previews, or None
    # runners.caches.StepCache per denoiser graph (None: the artifact's; a handover's second by its name), each
    # started at its first evaluation
    step_caches: dict = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage
    # the VAE posteriors this call encoded, by the pixels (runners.text_to_image's `vae_encode`)
    encoded: dict = field(default_factory=dict)


class Calls:
    """A pipeline's running calls: one per thread (a ContextVar of its own, so that a pipeline called inside
    another's call keeps apart from it), and, where an engine's backend cannot run two calls at once
    (`Backend.concurrent`), a lock that makes the second call wait for the first."""

    def __init__(self, name: str, concurrent: bool):
        self._running: ContextVar[Call | None] = ContextVar(name, default=None)
        # re-entrant: a call made from inside a call (an on_preview callback) in the same thread goes on
        self._one_at_a_time = None if concurrent else threading.RLock()

    @contextmanager
    def run(self, call: Call):
        with self._one_at_a_time or nullcontext():
            token = self._running.set(call)
            try:
                yield call
            finally:
                self._running.reset(token)

    @property
    def current(self) -> Call:
        """The calling thread's running call; outside one (a VAE decode called directly), a new empty one."""
        return self._running.get() or Call()
