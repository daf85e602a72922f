"""The Flux table's variants (bench/tables/flux.py). Each makes whole images from the same packed
starting latents and times the parts inside its own run: the transformer's seconds per step and
the VAE decode. diffusers' and optimum-intel's pipelines are timed by wrapping their transformer
and VAE, ours by the pipeline's stage timings (openvino.genai's row is bench.variants.GenAI). Every
variant runs at its defaults (FLUX.1-dev's: 512 T5 tokens, guidance embedding 3.5, no negative
prompt), so each does the same work."""
from __future__ import annotations

import time

import numpy as np

from bench.variants import Ours, pipeline_from, time_calls_of, timed_result
from bench.workload import PROMPT


class FluxOurs(Ours):
    """An artifact run by our runner (bench.variants.Ours), from packed starting latents at Flux's defaults."""

    def text_to_image(self, latents: np.ndarray, height: int, width: int, steps: int, **options) -> np.ndarray:
        return self.pipe(PROMPT, height=height, width=width, num_inference_steps=steps,
                         latents=self.pipe.layout.as_diffusers(latents),
                         output_type="np", **options)


class _FluxDiffusersCall:
    """A diffusers-style FluxPipeline (`source`: bench.variants.pipeline_from's), its transformer and VAE timed."""

    source: tuple[str, str]

    def __init__(self, folder: str):
        self.pipe = pipeline_from(self.source, folder)
        self.step_seconds, self.vae_seconds = [], []
        time_calls_of(self.pipe.transformer, "forward", self.step_seconds)
        time_calls_of(self.pipe.vae, "decode", self.vae_seconds)

    def timed_run(self, latents: np.ndarray, height: int, width: int, steps: int, out: str | None) -> dict:
        import torch

        self.step_seconds.clear()
        self.vae_seconds.clear()
        packed = self.pipe._pack_latents(torch.from_numpy(latents), *latents.shape)
        t0 = time.perf_counter()
        image = self.pipe(PROMPT, height=height, width=width, num_inference_steps=steps, latents=packed,
                          output_type="np").images[0]
        return timed_result(time.perf_counter() - t0, steps, sum(self.step_seconds), sum(self.vae_seconds), image, out)


class FluxDiffusers(_FluxDiffusersCall):
    """diffusers' FluxPipeline in fp32, eager."""
    source = ("diffusers", "FluxPipeline")


class FluxOptimumIntel(_FluxDiffusersCall):
    """optimum-intel's OVFluxPipeline on its own export (in .venv-optimum-intel), at its defaults."""
    source = ("optimum.intel", "OVFluxPipeline")


def make_flux_variant(kind: str, path: str, **options):
    kinds = {"flux-ours": FluxOurs, "flux-diffusers": FluxDiffusers, "flux-optimum-intel": FluxOptimumIntel}
    if kind not in kinds:
        raise ValueError(f"unknown Flux variant kind {kind!r}: choose from {', '.join(kinds)}")
    return kinds[kind](path, **options)
