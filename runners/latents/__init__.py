"""Latent layouts, a component as guidance rules are (runners/guidance.py): what a family's latents are, and how
they meet its denoiser, its VAE and diffusers' `latents=`. A family declares one (its pipeline's `layout`); the
starting latents, the loop's token counts (First-Block Cache's tail), static requests, previews and serving's
batched runs read it instead of assuming (N, C, h, w).

The loop works on unpacked latents: (N, C, h, w), a video's (N, C, F, h, w). Packing into tokens is a permutation,
so the scheduler's steps, image latents and inpainting blends are the same there; a family whose transformer reads
tokens packs them around each call (`pack`, `unpack`), with the layout's position ids."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from runners.latents.normalisation import PER_CHANNEL, SCALED, PerChannel, Scaled


@dataclass(frozen=True)
class LatentLayout:
    # a denoiser token's side in latent pixels: its hidden stream is the latents' patches (a frame's, each frame);
    # the export's patch_size, bound when a pipeline loads (TextToImage.__init__)
    patch: int = 1
    video: bool = False  # latents (N, C, F, h, w), F the causal 3D VAE's latent frames
    # diffusers' pipeline takes `latents=` and returns output_type="latent" as the transformer's tokens,
    # (N, [F x] h/patch x w/patch, C x patch²): FLUX.1's, Qwen-Image's, LTX-Video's
    packed_latents: bool = False
    # the tokens' position ids on a grid of rows x cols tokens, the call's `index`-th image (positions.py)
    positions: Callable[..., np.ndarray] | None = None
    normalisation: Scaled | PerChannel = SCALED
    # previews' latent-to-RGB maps by latent channel count, (channels x RGB, RGB bias) (runners/preview.py)
    latent_rgb: dict[int, tuple] = field(default_factory=dict)

    def shape(self, pipe, n: int, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """The loop's latents of `n` images (videos of `frames` frames) of height x width pixels."""
        scale = pipe.constants["vae_scale_factor"]
        sides = (height // scale, width // scale)
        if self.video:
            sides = ((frames - 1) // pipe.constants["vae_temporal_scale"] + 1, *sides)
        return (n, pipe.manifest["constants"]["latent_channels"], *sides)

    def tokens(self, sides) -> int:
        """The denoiser's tokens for latents of `sides` ((h, w) or (F, h, w)): its patches."""
        *frames, h, w = sides
        return int(np.prod(frames, dtype=np.int64)) * (h // self.patch) * (w // self.patch)

    def pack(self, latents: np.ndarray) -> np.ndarray:
        """(N, C, [F,] h, w) -> (N, [F x] h/p x w/p, C x p²), row by row, each token's channels (c, dy, dx): diffusers'
        _pack_latents (FLUX.1, Qwen-Image; a plain flatten at p = 1: FLUX.2, Qwen-Image 2.1, LTX-Video)."""
        n, c, *frames, h, w = latents.shape
        p = self.patch
        x = latents.reshape(n, c, -1, h // p, p, w // p, p).transpose(0, 2, 3, 5, 1, 4, 6)
        return np.ascontiguousarray(x.reshape(n, -1, c * p * p))

    def unpack(self, tokens: np.ndarray, sides) -> np.ndarray:
        """`pack`'s inverse, for latents of `sides` ((h, w) or (F, h, w)); tokens past the latents' (references
        after them) are dropped."""
        *frames, h, w = sides
        p, n = self.patch, len(tokens)
        f = int(np.prod(frames, dtype=np.int64))
        c = tokens.shape[2] // (p * p)
        x = tokens[:, :f * (h // p) * (w // p)].reshape(n, f, h // p, w // p, c, p, p).transpose(0, 4, 1, 2, 5, 3, 6)
        return np.ascontiguousarray(x.reshape(n, c, *frames, h, w))

    def from_diffusers(self, latents, shape: tuple[int, ...], pipeline: str) -> np.ndarray:
        """`latents=` as diffusers' `pipeline` takes them, as the loop takes them; `shape`: the request's loop latents
        (their count is checked with the request's, where they are used)."""
        latents = np.asarray(latents, dtype=np.float32)
        if not self.packed_latents:
            return latents
        tokens = (self.tokens(shape[2:]), shape[1] * self.patch**2)
        if latents.ndim != 3 or latents.shape[1:] != tokens:
            raise ValueError(f"latents have shape {latents.shape}; this request takes packed latents (N, {tokens[0]}, "
                             f"{tokens[1]}), as diffusers' {pipeline} does")
        return self.unpack(latents, shape[2:])

    def as_diffusers(self, latents: np.ndarray) -> np.ndarray:
        """The loop's latents as diffusers' pipeline takes them (`latents=`) and returns them (output_type="latent")."""
        return self.pack(latents) if self.packed_latents else latents

    def preview_frame(self, x0: np.ndarray) -> np.ndarray:
        """What a preview shows of latents: the image's, a video's middle latent frame."""
        return x0[:, :, x0.shape[2] // 2] if self.video else x0

    def rgb(self, channels: int) -> tuple | None:
        """The latent-to-RGB map for latents of `channels` channels; None: the family has none."""
        return self.latent_rgb.get(channels)


IMAGE = LatentLayout()
__all__ = ["IMAGE", "LatentLayout", "PER_CHANNEL", "SCALED"]
