"""DeepCache (Ma et al., 2023, https://arxiv.org/abs/2312.00858; the DeepCache library's `DeepCacheSDHelper`
with `set_params(cache_interval, cache_branch_id=0)`, its uniform mode): the U-Net's deep branch is reused
between full steps and only its shallowest layers run.

Rule, as the library applies it: a step runs in full when (i - i0) % cache_interval == 0, where i is the
position of the step's timestep in the scheduler's timesteps (its first one: PNDM repeats a timestep, and
both evaluations of it take that position) and i0 the first evaluation's. A full step keeps the hidden stream
its deeper layers give the last up block's last layer (`deep_feature`); a cached step runs the shallow
branch on it: the time embedding, `conv_in` and that last layer, then the output layers.

Branch 0 (the library's default, the shallowest and fastest) is the one the export writes. Guidance runs as
one batched call, as in diffusers' pipelines, so one decision covers both halves. A ControlNet still runs
at every step; the shallow branch takes its residual for conv_in's output (the library leaves ControlNets
alone too, and the U-Net adds that residual to the skip connection the last layer reads).

The graphs (export/families/deep_cache.py): `unet_shallow` gives the cached step's prediction; the U-Net
gives `deep_feature` beside its prediction."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runners.caches.base import GraphCacheConfig, StepCache, register

SHALLOW = "unet_shallow"  # the graph export/families/deep_cache.py writes
FEATURE = "deep_feature"  # the U-Net's output the shallow graph takes


class DeepCache(StepCache):
    def __init__(self, config: DeepCacheConfig, pipe, num_steps: int):
        super().__init__(pipe, num_steps)
        self.config = config
        self.positions: dict[float, int] = {}  # timestep -> the step it first came at: its place in the timesteps
        self.features: dict[str, np.ndarray] = {}  # context -> deep_feature of its last full step

    def evaluate(self, step, context, inputs, run_full):
        x, t, conditions = inputs
        position = self.positions.setdefault(float(t), step)  # i - i0: the loop's first step is 0
        last = step == self.num_steps - 1
        feature = self.features.get(context)
        if position % self.config.cache_interval == 0 or feature is None or len(feature) != len(x):
            out = self.pipe._predict(x, t, conditions, release=last, engine=self.engine)
            self.features[context] = np.array(out[FEATURE])
            return out["noise_pred"], "full"
        out = self.pipe._predict(x, t, conditions, release=last, engine=self.graph, **{FEATURE: feature})
        return np.array(out["noise_pred"]), "cached"  # a copy: the backend may reuse its buffers


@register("deepcache", {"interval": "cache_interval", "branch": "cache_branch_id"})
@dataclass(frozen=True)
class DeepCacheConfig(GraphCacheConfig):
    cache_interval: int = 3  # the library's README's (its `set_params` default, 1, caches nothing)
    cache_branch_id: int = 0
    positional = "cache_interval"  # "deepcache:3"
    graph, output, title = SHALLOW, FEATURE, "DeepCache"
    needs = "the U-Net's shallow branch"
    instead = ("a transformer: use first-block or taylorseer; a U-Net exported before it: export the model again "
               "and rebuild")
    state = DeepCache

    def __post_init__(self):
        self._check_int("cache_interval", 1)
        if self.cache_branch_id != 0 or isinstance(self.cache_branch_id, bool):
            raise ValueError(f"DeepCacheConfig: cache_branch_id={self.cache_branch_id!r} is not allowed: the export "
                             "writes the shallow branch of branch 0 only (the library's default and fastest)")
