"""What inpainting adds to the denoising loop, as diffusers' Inpaint pipelines do it: a denoiser with
the latents' own channels gets the known part back after every step (the image's latents, noised
to the next step's level); an inpainting denoiser (SD1.5's 9 channels) reads the mask and the
masked image's latents as extra input channels instead."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runners.conditioning.images import nearest


def latent_mask(mask: np.ndarray, size: tuple[int, int], n_images: int, resize=nearest) -> np.ndarray:
    """The pixel mask (N, 1, H, W) at latent size (by `resize`: torch's nearest interpolate, or a family's
    pipeline's), repeated for the images to generate as diffusers repeats it (the whole batch)."""
    small = resize(mask, *size)
    return np.concatenate([small] * (n_images // len(small)))


@dataclass
class Inpainting:
    mask: np.ndarray  # (images, 1, h, w) at latent size: 1 repaints, 0 keeps the image
    noise: np.ndarray  # the noise the starting latents were given, re-used for the known part
    image_latents: np.ndarray | None  # blended back after every step; None for an inpainting denoiser
    channels: np.ndarray | None  # the mask and the masked image's latents (x2 with guidance), or None

    def inputs(self, x: np.ndarray) -> np.ndarray:
        """The denoiser's latent input: `x`, with the extra channels of an inpainting denoiser (a step that runs the
        prompt's half alone, as a handover to a guidance scale of 1 does, takes one half: both are the same)."""
        return x if self.channels is None else np.concatenate([x, self.channels[:len(x)]], axis=1)

    def blend(self, latents: np.ndarray, schedule, i: int) -> np.ndarray:
        """After step `i`: the known part from the image, at the noise level of the step that follows
        (none after the last)."""
        if self.image_latents is None:
            return latents
        known = self.image_latents
        if i < len(schedule.timesteps) - 1:
            known = schedule.noised(known, self.noise, i + 1)
        return (np.float32(1) - self.mask) * known + self.mask * latents
