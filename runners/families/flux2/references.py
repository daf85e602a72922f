"""FLUX.2's reference images (Flux2KleinPipeline's `image=`): each one kept at most 1024 x 1024 pixels
(LANCZOS to that area), centre-cropped to multiples of 16, encoded alone to its latents' mode, packed as
tokens with position ids (T, row, column, 0) whose T is 10 for the first, 20 for the second, ..."""
from __future__ import annotations

import math

import numpy as np


TIME_OFFSET = 10  # reference i's ids have T = 10 (i + 1)
MIN_SIDE, MAX_RATIO = 64, 8  # Flux2ImageProcessor.check_image_input's


def _checked(images) -> list:
    from PIL import Image

    images = list(images) if isinstance(images, (list, tuple)) else [images]
    if not images or not all(isinstance(i, Image.Image) for i in images):
        raise ValueError("image= (FLUX.2's reference images) must be a PIL image or a non-empty list of them, as "
                         "Flux2KleinPipeline takes them")
    for i, image in enumerate(images):
        w, h = image.size
        if min(w, h) < MIN_SIDE or max(w / h, h / w) > MAX_RATIO:
            raise ValueError(f"reference image {i} is {w}x{h}: FLUX.2 takes references whose sides are at least "
                             f"{MIN_SIDE} pixels and whose aspect ratio is at most {MAX_RATIO}:1")
    return images


def prepared(image, max_area: int, multiple: int):
    """A reference as the pipeline prepares it: (1, 3, h, w) in [-1, 1]."""
    image = capped(image.convert("RGB"), max_area)
    w, h = image.size
    width, height = w // multiple * multiple, h // multiple * multiple
    left, top = (w - width) // 2, (h - height) // 2
    image = image.crop((left, top, left + width, top + height))
    return (np.asarray(image, dtype=np.float32) / 255 * 2 - 1).transpose(2, 0, 1)[None]


def capped(image, max_area: int):
    """A PIL image resized (LANCZOS) to `max_area` pixels where it has more, as the pipelines do first."""
    from PIL import Image

    w, h = image.size
    if w * h <= max_area:
        return image
    scale = math.sqrt(max_area / (w * h))
    return image.resize((int(w * scale), int(h * scale)), Image.Resampling.LANCZOS)


def reference_tokens(pipe, images, vae_tiling=None, first: int = 1) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    """(tokens (1, n, channels), their ids (n, 4), the first reference's (height, width) in pixels); the
    references' T offsets counted from the `first`th (Flux2KleinInpaintPipeline's image to repaint is the first)."""
    c = pipe.constants
    tokens, ids, size = [], [], None
    for i, image in enumerate(_checked(images)):
        pixels = prepared(image, c["reference_area"], c["vae_scale_factor"])
        size = size or pixels.shape[2:]
        latent = pipe.vae_encode(pixels, tiling=vae_tiling)[0]  # the posterior's mode, as the pipeline reads it
        tokens.append(pipe.layout.pack(latent))
        ids.append(pipe.layout.positions(*latent.shape[2:], index=TIME_OFFSET * (i + first)))
    return np.concatenate(tokens, axis=1), np.concatenate(ids), tuple(int(s) for s in size)
