"""First-Block Cache (ParaAttention's, diffusers' `FirstBlockCacheConfig` and `apply_first_block_cache`):
every step runs the transformer's first block; when its residual (output minus input, the hidden
stream) moved little since the last step that ran in full, the remaining blocks are skipped and their
residual from that step is added back to the first block's output.

Rule, as diffusers' hooks apply it, per context: a step runs in full when the context has no full
step yet, or when mean|r - r_full| / mean|r_full| > threshold, where r is this step's first-block
residual and r_full the one of the context's last full step (a cached step does not replace it). On a
full step the tail residual (the hidden stream after the last block minus after the first) is kept; on
a cached step the prediction is the final norm and projection of the first block's output plus it.
The comparison takes the whole batch of one context: SD3's pipeline runs guidance as one batched
call (one context), Flux's runs the negative and the positive prompt as two calls with their own
contexts, and the runner's batched call keeps their halves apart ("uncond,cond": each half decides
alone; when only one half hits, the call runs in full and that half takes its cached prediction).

The graphs (export/families/first_block.py): `transformer_first_block` gives the residual and the
cached prediction; the transformer gives `tail_residual` beside its prediction."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from runners.caches.base import GraphCacheConfig, StepCache, register

FIRST_BLOCK = "transformer_first_block"  # the graph export/families/first_block.py writes


class _Context:
    """One context's state: the first block's residual and the tail residual of its last full step."""

    def __init__(self):
        self.residual: np.ndarray | None = None
        self.tail: np.ndarray | None = None

    def runs_in_full(self, residual: np.ndarray, threshold: float) -> bool:
        if self.residual is None or self.residual.shape != residual.shape:
            return True
        change = np.abs(residual - self.residual).mean(dtype=np.float64) / np.abs(self.residual).mean(dtype=np.float64)
        return bool(change > threshold)


class FirstBlockCache(StepCache):
    def __init__(self, config: FirstBlockCacheConfig, pipe, num_steps: int):
        super().__init__(pipe, num_steps)
        self.config = config
        self.contexts: dict[str, _Context] = {}
        # per context, per step: whether it ran in full (`Pipeline.cache_stats["decisions"]`)
        self.decisions: dict[str, list[bool]] = self.stats.setdefault("decisions", {})

    def evaluate(self, step, context, inputs, run_full):
        x, t, conditions = inputs
        names = context.split(",")
        states = [self.contexts.setdefault(name, _Context()) for name in names]
        last = step == self.num_steps - 1
        first = self.pipe._predict(x, t, conditions, release=last, engine=self.graph,
                                   tail_residual=self._tails(states, x, conditions))
        residuals = np.split(first["first_block_residual"], len(names))
        full = [state.runs_in_full(r, self.config.threshold) for state, r in zip(states, residuals)]
        for name, decision in zip(names, full):
            self.decisions.setdefault(name, []).append(decision)
        if not any(full):
            return np.array(first["noise_pred"]), "cached"  # a copy: the backend may reuse its buffers
        cached = np.split(np.array(first["noise_pred"]), len(names))
        residuals = [np.array(r) for r in residuals]
        out = self.pipe._predict(x, t, conditions, release=last, engine=self.engine)
        predictions = np.split(out["noise_pred"], len(names))
        for i, (state, tail) in enumerate(zip(states, np.split(out["tail_residual"], len(names)))):
            if full[i]:
                state.residual, state.tail = residuals[i], np.array(tail)
            else:
                predictions[i] = cached[i]
        return np.concatenate(predictions), "full"

    def _tails(self, states, x: np.ndarray, conditions: dict) -> np.ndarray:
        """The tail residuals the first-block graph adds: the contexts' parts of the batch side by side, zeros
        where a context has none yet for this shape (its step runs in full whatever the graph predicts)."""
        n = x.shape[0]
        shape = (n // len(states), self.pipe.hidden_tokens(x.shape[2:], conditions),
                 self.pipe.manifest["constants"]["inner_dim"])
        return np.concatenate([s.tail if s.tail is not None and s.tail.shape == shape else np.zeros(shape, np.float32)
                               for s in states])


@register("first-block", {"threshold": "threshold"})
@dataclass(frozen=True)
class FirstBlockCacheConfig(GraphCacheConfig):
    threshold: float = 0.05
    positional = "threshold"  # "first-block:0.08"
    graph, output, title = FIRST_BLOCK, "tail_residual", "First-Block Cache"
    needs = "the transformer split after its first block"
    instead = "a U-Net, or exported before the split: export the model again and rebuild, or use taylorseer"
    state = FirstBlockCache

    def __post_init__(self):
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float, np.number)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"FirstBlockCacheConfig: threshold={t!r} is not allowed: use a finite number >= 0 "
                             "(diffusers' default 0.05; higher skips more steps)")
