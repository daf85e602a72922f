"""TaylorSeer lite (https://huggingface.co/papers/2503.06923, diffusers' `TaylorSeerCacheConfig`
with `use_lite_mode=True`): on a cached step the denoiser's whole output is extrapolated from its
last full evaluations with a Taylor series whose factors are finite differences, so nothing inside
the graph is needed and it runs on every artifact and target.

Schedule (diffusers' rule, step counted per context from 0): a step runs in full when
step < disable_cache_before_step, or (step - disable_cache_before_step - 1) % cache_interval == 0,
or step >= disable_cache_after_step; the others are extrapolated. A full step refreshes the
factors: order 0 is the output, order k+1 the difference of order k with the previous full step's,
over the steps between them. A negative disable_cache_after_step counts from the end, as
openvino.genai's does (-2: the last two steps run in full). The factors are float32 (diffusers'
`taylor_factors_dtype=torch.float32`); the first evaluation of a context always runs in full (with
nothing to extrapolate from, diffusers would fail)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from runners.caches.base import CacheConfig, StepCache, register


@register("taylorseer", {"interval": "cache_interval", "before": "disable_cache_before_step",
                         "after": "disable_cache_after_step", "order": "max_order", "lite": "use_lite_mode"})
@dataclass(frozen=True)
class TaylorSeerCacheConfig(CacheConfig):
    cache_interval: int = 5
    disable_cache_before_step: int = 3
    disable_cache_after_step: int | None = None
    max_order: int = 1
    use_lite_mode: bool = True

    def __post_init__(self):
        self._check_int("cache_interval", 1)
        self._check_int("disable_cache_before_step", 0)
        self._check_int("max_order", 0)
        after = self.disable_cache_after_step
        if after is not None and (isinstance(after, bool) or not isinstance(after, (int, np.integer))):
            raise ValueError(f"TaylorSeerCacheConfig: disable_cache_after_step={after!r} is not allowed: use an "
                             "integer (negative counts from the last step: -2 runs the last two in full) or None")
        if self.use_lite_mode is not True:
            raise ValueError("TaylorSeerCacheConfig: use_lite_mode=False caches each attention block's output, which a "
                             "compiled graph does not expose: only use_lite_mode=True (the whole output) is supported")

    def start(self, pipe, num_steps: int, engine: str | None = None) -> "TaylorSeerCache":
        return TaylorSeerCache(self, pipe, num_steps)

    def runs_in_full(self, step: int, num_steps: int) -> bool:
        """diffusers' schedule (see the module's docstring)."""
        after = self.disable_cache_after_step
        if after is not None and after < 0:
            after += num_steps
        before = self.disable_cache_before_step
        return step < before or (step - before - 1) % self.cache_interval == 0 or (after is not None and step >= after)


class _Factors:
    """One context's Taylor factors (order 0 first) and the step they were taken at."""

    def __init__(self):
        self.step: int | None = None
        self.factors: list[np.ndarray] = []

    def update(self, output: np.ndarray, step: int, max_order: int) -> None:
        new = [np.array(output, dtype=np.float32)]  # a copy: the backend may reuse its output buffer
        if self.step is not None:
            delta = np.float32(step - self.step)
            for previous in self.factors[:max_order]:
                if previous.shape != new[-1].shape:  # another batch or size: start over from order 0
                    break
                new.append((new[-1] - previous) / delta)
        self.factors, self.step = new, step

    def predict(self, step: int) -> np.ndarray:
        offset = step - self.step
        output = self.factors[0].copy()
        for order, factor in enumerate(self.factors[1:], start=1):
            output += factor * np.float32(offset**order / math.factorial(order))
        return output


class TaylorSeerCache(StepCache):
    def __init__(self, config: TaylorSeerCacheConfig, pipe, num_steps: int):
        super().__init__(pipe, num_steps)
        self.config = config
        self.contexts: dict[str, _Factors] = {}

    def evaluate(self, step, context, inputs, run_full):
        state = self.contexts.setdefault(context, _Factors())
        if state.step is not None and not self.config.runs_in_full(step, self.num_steps):
            return state.predict(step), "cached"
        # No later full step: the denoiser's working memory goes now, not after an extrapolated last step.
        later = any(self.config.runs_in_full(s, self.num_steps) for s in range(step + 1, self.num_steps))
        output = run_full(release=not later)
        state.update(output, step, self.config.max_order)
        return output, "full"
