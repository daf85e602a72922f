"""The deployable runner: loads an artifact folder and runs the whole pipeline with numpy,
tokenizers, Pillow and one backend. It never imports torch, diffusers or transformers."""
from runners.caches import DeepCacheConfig, FirstBlockCacheConfig, TaylorSeerCacheConfig
from runners.pipeline import Pipeline
import runners.families  # noqa: F401  (each family registers itself with Pipeline.load)

__all__ = ["DeepCacheConfig", "FirstBlockCacheConfig", "Pipeline", "TaylorSeerCacheConfig"]
