"""FLUX.2's latents as the transformer's tokens: (N, C, h, w) packed to (N, h * w, C) row by row, and
the 4-axis position ids (T, H, W, L) of an image's tokens and of the text's; the pipeline's 128 channels
unpatchified to the VAE's 32 at twice the side."""
from __future__ import annotations

import numpy as np


def pack(latents: np.ndarray) -> np.ndarray:
    n, c, h, w = latents.shape
    return np.ascontiguousarray(latents.reshape(n, c, h * w).transpose(0, 2, 1))


def unpack(tokens: np.ndarray, h: int, w: int) -> np.ndarray:
    n, _, c = tokens.shape
    return np.ascontiguousarray(tokens.transpose(0, 2, 1).reshape(n, c, h, w))


def positions(h: int, w: int, t: int = 0) -> np.ndarray:
    """(h * w, 4) float32: (t, row, column, 0) for an image's tokens, row-major."""
    ids = np.zeros((h, w, 4), dtype=np.float32)
    ids[..., 0] = t
    ids[..., 1] = np.arange(h)[:, None]
    ids[..., 2] = np.arange(w)[None, :]
    return ids.reshape(h * w, 4)


def text_positions(length: int) -> np.ndarray:
    """(length, 4) float32: (0, 0, 0, l)."""
    ids = np.zeros((length, 4), dtype=np.float32)
    ids[:, 3] = np.arange(length)
    return ids


def unpatchify(latents: np.ndarray) -> np.ndarray:
    """(N, 4C, h, w) -> (N, C, 2h, 2w): channel c * 4 + dy * 2 + dx to its pixel (Flux2KleinPipeline's
    _unpatchify_latents; export/families/flux2.py's in the decoder's graph)."""
    n, c, h, w = latents.shape
    x = latents.reshape(n, c // 4, 2, 2, h, w).transpose(0, 1, 4, 2, 5, 3)
    return np.ascontiguousarray(x.reshape(n, c // 4, h * 2, w * 2))
