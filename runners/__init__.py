"""The deployable runner: loads an artifact folder and runs the whole pipeline with numpy,
tokenizers, Pillow and one backend. It never imports torch, diffusers or transformers."""
from runners.caches import DeepCacheConfig, FirstBlockCacheConfig, TaylorSeerCacheConfig
from runners.pipeline import Pipeline
from runners import flux, sd3, sd15, sdxl  # noqa: F401  (each family registers itself with Pipeline.load)

__all__ = ["DeepCacheConfig", "FirstBlockCacheConfig", "Pipeline", "TaylorSeerCacheConfig"]
