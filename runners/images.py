"""VAE output -> what the caller asked for, as diffusers' VaeImageProcessor.postprocess does."""
from __future__ import annotations

import numpy as np


def to_output(image: np.ndarray, output_type: str):
    """(N, 3, H, W) in [-1, 1] -> (N, H, W, 3) floats in [0, 1] for "np", PIL images for "pil"."""
    array = np.clip(image / 2 + 0.5, 0, 1).transpose(0, 2, 3, 1)
    if output_type == "np":
        return array
    from PIL import Image

    return [Image.fromarray(a) for a in (array * 255).round().astype(np.uint8)]
