"""Step caches: configs that the denoising loop consults at every denoiser evaluation, with
diffusers' names and meanings (`diffusers.hooks`), so that a run can skip evaluations.

A cache is one file here: a config dataclass (what the user sets) whose `start()` returns a
`StepCache`, the state of one call (a cache that runs a second graph of the denoiser on its cached
steps subclasses `GraphCacheConfig`: First-Block Cache, DeepCache). The loop asks the state for each evaluation
(`StepCache.__call__`); the state runs the denoiser in full or answers from what it kept, and
counts both. A fresh state starts with every call, so no call sees another's outputs.

`Pipeline.enable_cache(config)` / `disable_cache()` / `pipe(..., cache=config)`; the CLI and
serving spell a config as text, parsed by `parse_cache` ("taylorseer:interval=3,before=6")."""
from runners.caches.base import (CONFIGS, CacheConfig, StepCache, cache_graphs, graph_caches, merged_stats,
                                 parse_cache)
from runners.caches.deep_cache import DeepCacheConfig  # registers itself with parse_cache
from runners.caches.first_block import FirstBlockCacheConfig  # registers itself with parse_cache
from runners.caches.taylorseer import TaylorSeerCacheConfig  # registers itself with parse_cache

__all__ = ["CONFIGS", "CacheConfig", "DeepCacheConfig", "FirstBlockCacheConfig", "StepCache", "TaylorSeerCacheConfig",
           "cache_graphs", "graph_caches", "merged_stats", "parse_cache"]
