"""FLUX.2's latents as the VAE takes them: the pipeline's 128 channels unpatchified to the VAE's 32 at twice the
side."""
from __future__ import annotations

import numpy as np


def unpatchify(latents: np.ndarray) -> np.ndarray:
    """(N, 4C, h, w) -> (N, C, 2h, 2w): channel c * 4 + dy * 2 + dx to its pixel (Flux2KleinPipeline's
    _unpatchify_latents; export/families/flux2.py's in the decoder's graph)."""
    n, c, h, w = latents.shape
    x = latents.reshape(n, c // 4, 2, 2, h, w).transpose(0, 1, 4, 2, 5, 3)
    return np.ascontiguousarray(x.reshape(n, c // 4, h * 2, w * 2))
