"""How a layout's latents (the denoiser's) become the VAE's and back: the VAE config's scalar scaling and shift
(SD, SD3, FLUX.1, Z-Image; 1 and 0 where the export put the VAE's statistics inside its graphs: Qwen-Image, Wan,
FLUX.2's batch norm), or per-channel mean and standard deviation applied by the runner (LTX-Video)."""
from __future__ import annotations

import numpy as np


class Scaled:
    """z = latents / scaling + shift: the factors of the VAE that decodes (`vae`: "full", "tiny" or None for
    the one the pipeline decodes with: `TextToImage.vae_factors`)."""

    def to_vae(self, pipe, latents: np.ndarray, shift: bool = True, vae: str | None = None) -> np.ndarray:
        scaling, shift_factor = pipe.vae_factors(vae)
        return latents / np.float32(scaling) + np.float32(shift_factor if shift else 0)

    def from_vae(self, pipe, z: np.ndarray, shift: bool = True) -> np.ndarray:
        scaling, shift_factor = pipe.vae_factors()
        return (z - np.float32(shift_factor if shift else 0)) * np.float32(scaling)


class PerChannel:
    """z = latents x std / scaling + mean, per latent channel (LTXPipeline's _denormalize_latents), over 4-D or 5-D
    latents; the tiny VAE has none of its own."""

    @staticmethod
    def statistics(pipe, ndim: int) -> tuple[np.ndarray, np.ndarray]:
        shape = (1, -1) + (1,) * (ndim - 2)
        return tuple(np.asarray(pipe.constants[k], dtype=np.float32).reshape(shape)
                     for k in ("latents_mean", "latents_std"))

    def to_vae(self, pipe, latents: np.ndarray, shift: bool = True, vae: str | None = None) -> np.ndarray:
        mean, std = self.statistics(pipe, latents.ndim)
        return latents * std / np.float32(pipe.constants["vae_scaling_factor"]) + mean

    def from_vae(self, pipe, z: np.ndarray, shift: bool = True) -> np.ndarray:
        mean, std = self.statistics(pipe, z.ndim)
        return (z - mean) * np.float32(pipe.constants["vae_scaling_factor"]) / std


SCALED, PER_CHANNEL = Scaled(), PerChannel()
