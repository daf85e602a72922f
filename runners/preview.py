"""Live previews: every N steps, the current estimate of the final latents (the scheduler's x0
prediction; a video's middle latent frame) made visible, through the artifact's tiny decoder when it has
one (`vae_decoder_tiny`), else through a fixed linear map of the latent channels to RGB. The time they
take is the call's `timings["previews"]`; they never touch the latents the loop carries on with.

The latent-to-RGB matrices (channels x RGB, and a bias; each family's layout's `latent_rgb`) are ComfyUI's
`latent_rgb_factors` and `latent_rgb_factors_bias` (comfy/latent_formats.py, fitted by its authors on real images); they
apply to the latents as the denoiser sees them (scaled, and shifted for SD3 and Flux), and give
RGB in [-1, 1] at the latent resolution, enlarged here to the image's size."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from runners.conditioning.images import to_output
from runners.latents import SCALED


class Previews:
    """One call's previews: `on_preview(step, images)` after every `every` steps (step counts the
    steps done, from 1), with PIL images of the output's size."""

    def __init__(self, pipe, every: int, on_preview: Callable):
        self.pipe, self.every, self.on_preview = pipe, every, on_preview

    @classmethod
    def for_call(cls, pipe, every, on_preview) -> "Previews | None":
        if every is None and on_preview is None:
            return None
        if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every < 1:
            raise ValueError(f"preview_every={every!r} is not allowed: use an integer >= 1 (a preview every that many "
                             "steps) together with on_preview")
        if not callable(on_preview):
            raise ValueError(f"on_preview={on_preview!r:.40} is not callable: pass a function (step, images)")
        if "vae_decoder_tiny" not in pipe.sessions and pipe.layout.rgb(pipe.manifest["constants"]["latent_channels"]) \
                is None:
            family = pipe.manifest["model"]["family"]
            raise ValueError(f"previews need a tiny decoder or a latent-to-RGB map; this {family} artifact has "
                             "neither: export it with --tiny-vae")
        return cls(pipe, every, on_preview)

    def __call__(self, step: int, x0: np.ndarray) -> None:
        """After step `step` (0-based) with `x0`, the predicted clean latents (as the denoiser sees them)."""
        if (step + 1) % self.every:
            return
        x0 = self.pipe.layout.preview_frame(x0)
        t0 = time.perf_counter()
        self.on_preview(step + 1, to_output(self._pixels(x0), "pil"))
        timings = self.pipe._calls.current.timings
        timings["previews"] = timings.get("previews", 0.0) + time.perf_counter() - t0

    def _pixels(self, x0: np.ndarray) -> np.ndarray:
        """(N, 3, H, W) in [-1, 1] at the image's size."""
        pipe = self.pipe
        if "vae_decoder_tiny" in pipe.sessions:
            return pipe.run("vae_decoder_tiny", latent=SCALED.to_vae(pipe, x0, vae="tiny"))["image"].copy()
        matrix, bias = (np.asarray(v, dtype=np.float32) for v in pipe.layout.rgb(x0.shape[1]))
        rgb = np.einsum("nchw,cr->nrhw", x0, matrix) + bias[:, None, None]
        scale = pipe.constants["vae_scale_factor"]
        return rgb.repeat(scale, axis=2).repeat(scale, axis=3)
