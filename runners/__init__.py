"""The deployable runner: loads an artifact folder and runs the whole pipeline with numpy,
tokenizers, Pillow and one backend. It never imports torch, diffusers or transformers."""
from runners.pipeline import Pipeline

__all__ = ["Pipeline"]
