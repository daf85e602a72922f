"""The Z-Image table's variants (bench/tables/z_image.py). Each makes an image of the same 20-word prompt from
the same starting latents at Turbo's settings (guidance 0: no negative prompt), and times its parts inside
its own run: the text encoder, the transformer's seconds per step and the VAE decode. diffusers' and
optimum-intel's pipelines are timed by wrapping their modules; ours by the pipeline's stage timings;
openvino.genai's by its performance metrics (bench.variants.GenAI)."""
from __future__ import annotations

import time

import numpy as np

from bench.variants import Ours, pipeline_from, time_calls_of, timed_result

# 20 words: the measure of the text encoder (openvino.genai pads every prompt to its maximum length)
PROMPT = ("a photo of an astronaut riding a horse on the moon at sunset, detailed, golden light, "
          "soft shadows, wide angle")
TURBO = {"guidance_scale": 0.0}  # Z-Image-Turbo's guidance (its model card's): no negative prompt, one batch


class ZImageOurs(Ours):
    def timed_run(self, latents: np.ndarray, height: int, width: int, steps: int, out: str | None) -> dict:
        t0 = time.perf_counter()
        image = self.pipe(PROMPT, height=height, width=width, num_inference_steps=steps, latents=latents,
                          output_type="np", **TURBO)[0]
        seconds, timings = time.perf_counter() - t0, self.pipe.timings
        return timed_result(seconds, steps, timings["denoise"], timings["vae_decode"], image, out,
                            text=timings["text_encoders"])


class _ZImageDiffusersCall:
    """A diffusers-style ZImagePipeline (`source`: bench.variants.pipeline_from's), its text encoder, transformer
    and VAE timed."""

    source: tuple[str, str]

    def __init__(self, folder: str):
        self.pipe = pipeline_from(self.source, folder)
        self.text_seconds, self.step_seconds, self.vae_seconds = [], [], []
        time_calls_of(self.pipe.text_encoder, "forward", self.text_seconds)
        time_calls_of(self.pipe.transformer, "forward", self.step_seconds)
        time_calls_of(self.pipe.vae, "decode", self.vae_seconds)

    def timed_run(self, latents: np.ndarray, height: int, width: int, steps: int, out: str | None) -> dict:
        import torch

        for seconds in (self.text_seconds, self.step_seconds, self.vae_seconds):
            seconds.clear()
        t0 = time.perf_counter()
        image = self.pipe(PROMPT, height=height, width=width, num_inference_steps=steps,
                          latents=torch.from_numpy(latents), output_type="np", **TURBO).images[0]
        return timed_result(time.perf_counter() - t0, steps, sum(self.step_seconds), sum(self.vae_seconds), image, out,
                            text=sum(self.text_seconds))


class ZImageDiffusers(_ZImageDiffusersCall):
    """diffusers' ZImagePipeline in fp32, eager."""
    source = ("diffusers", "ZImagePipeline")


class ZImageOptimumIntel(_ZImageDiffusersCall):
    """optimum-intel's OVZImagePipeline on its own export (in .venv-optimum-intel), at its defaults."""
    source = ("optimum.intel", "OVZImagePipeline")


def make_z_image_variant(kind: str, path: str, **options):
    kinds = {"z-image-ours": ZImageOurs, "z-image-diffusers": ZImageDiffusers,
             "z-image-optimum-intel": ZImageOptimumIntel}
    if kind not in kinds:
        raise ValueError(f"unknown Z-Image variant kind {kind!r}: choose from {', '.join(kinds)}")
    return kinds[kind](path, **options)
