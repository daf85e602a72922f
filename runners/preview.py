"""Live previews: every N steps, the current estimate of the final latents (the scheduler's x0
prediction) made visible, through the artifact's tiny decoder when it has one (`vae_decoder_tiny`),
else through a fixed linear map of the latent channels to RGB. The time they take is the call's
`timings["previews"]`; they never touch the latents the loop carries on with.

The latent-to-RGB matrices (channels x RGB, and a bias) are ComfyUI's `latent_rgb_factors` and
`latent_rgb_factors_bias` (comfy/latent_formats.py, fitted by its authors on real images); they
apply to the latents as the denoiser sees them (scaled, and shifted for SD3 and Flux), and give
RGB in [-1, 1] at the latent resolution, enlarged here to the image's size."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from runners.images import to_output

LATENT_RGB = {  # family -> (channels x 3 matrix, bias)
    "sd15": ([[0.3512, 0.2297, 0.3227], [0.3250, 0.4974, 0.2350], [-0.2829, 0.1762, 0.2721],
              [-0.2120, -0.2616, -0.7177]], [0.0, 0.0, 0.0]),
    "sdxl": ([[0.3651, 0.4232, 0.4341], [-0.2533, -0.0042, 0.1068], [0.1076, 0.1111, -0.0362],
              [-0.3165, -0.2492, -0.2188]], [0.1084, -0.0175, -0.0011]),
    "sd3": ([[-0.0922, -0.0175, 0.0749], [0.0311, 0.0633, 0.0954], [0.1994, 0.0927, 0.0458],
             [0.0856, 0.0339, 0.0902], [0.0587, 0.0272, -0.0496], [-0.0006, 0.1104, 0.0309],
             [0.0978, 0.0306, 0.0427], [-0.0042, 0.1038, 0.1358], [-0.0194, 0.0020, 0.0669],
             [-0.0488, 0.0130, -0.0268], [0.0922, 0.0988, 0.0951], [-0.0278, 0.0524, -0.0542],
             [0.0332, 0.0456, 0.0895], [-0.0069, -0.0030, -0.0810], [-0.0596, -0.0465, -0.0293],
             [-0.1448, -0.1463, -0.1189]], [0.2394, 0.2135, 0.1925]),
    "flux": ([[-0.0346, 0.0244, 0.0681], [0.0034, 0.0210, 0.0687], [0.0275, -0.0668, -0.0433],
              [-0.0174, 0.0160, 0.0617], [0.0859, 0.0721, 0.0329], [0.0004, 0.0383, 0.0115],
              [0.0405, 0.0861, 0.0915], [-0.0236, -0.0185, -0.0259], [-0.0245, 0.0250, 0.1180],
              [0.1008, 0.0755, -0.0421], [-0.0515, 0.0201, 0.0011], [0.0428, -0.0012, -0.0036],
              [0.0817, 0.0765, 0.0749], [-0.1264, -0.0522, -0.1103], [-0.0280, -0.0881, -0.0499],
              [-0.1262, -0.0982, -0.0778]], [-0.0329, -0.0718, -0.0851]),
}


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
        if "vae_decoder_tiny" not in pipe.sessions and pipe.manifest["model"]["family"] not in LATENT_RGB:
            family = pipe.manifest["model"]["family"]
            raise ValueError(f"previews need a tiny decoder or a latent-to-RGB map; this {family} artifact has "
                             "neither: export it with --tiny-vae")
        return cls(pipe, every, on_preview)

    def __call__(self, step: int, x0: np.ndarray) -> None:
        """After step `step` (0-based) with `x0`, the predicted clean latents (as the denoiser sees them)."""
        if (step + 1) % self.every:
            return
        t0 = time.perf_counter()
        self.on_preview(step + 1, to_output(self._pixels(x0), "pil"))
        timings = self.pipe.timings
        timings["previews"] = timings.get("previews", 0.0) + time.perf_counter() - t0

    def _pixels(self, x0: np.ndarray) -> np.ndarray:
        """(N, 3, H, W) in [-1, 1] at the image's size."""
        pipe = self.pipe
        if "vae_decoder_tiny" in pipe.sessions:
            scaling, shift = pipe.vae_factors("tiny")
            return pipe.run("vae_decoder_tiny", latent=x0 / np.float32(scaling) + np.float32(shift))["image"].copy()
        matrix, bias = (np.asarray(v, dtype=np.float32) for v in LATENT_RGB[pipe.manifest["model"]["family"]])
        rgb = np.einsum("nchw,cr->nrhw", x0, matrix) + bias[:, None, None]
        scale = pipe.constants["vae_scale_factor"]
        return rgb.repeat(scale, axis=2).repeat(scale, axis=3)
