"""Position ids of a transformer's tokens, as the diffusers pipelines compute them, on a grid of `rows` x `cols`
tokens (a layout's `positions`: an image's tokens, and the references' after them with their `index`)."""
from __future__ import annotations

import numpy as np


def flux1(rows: int, cols: int, index: int = 0) -> np.ndarray:
    """(rows * cols, 3) float32: (index, row, column), row-major: FLUX.1's _prepare_latent_image_ids (index 0 the
    image, 1 FLUX.1 Kontext's reference)."""
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    return np.stack([np.full_like(r, index), r, c], axis=-1).reshape(-1, 3).astype(np.float32)


def flux2(rows: int, cols: int, index: int = 0) -> np.ndarray:
    """(rows * cols, 4) float32: (T, row, column, 0), row-major: FLUX.2's (T = `index`: 0 the image, the references
    at their time offsets)."""
    ids = np.zeros((rows, cols, 4), dtype=np.float32)
    ids[..., 0] = index
    ids[..., 1] = np.arange(rows)[:, None]
    ids[..., 2] = np.arange(cols)[None, :]
    return ids.reshape(rows * cols, 4)


def flux2_text(length: int) -> np.ndarray:
    """(length, 4) float32: FLUX.2's text tokens, (0, 0, 0, l)."""
    ids = np.zeros((length, 4), dtype=np.float32)
    ids[:, 3] = np.arange(length)
    return ids


def qwen(rows: int, cols: int, index: int = 0) -> np.ndarray:
    """(rows * cols, 3) float32: (frame, row, column), the rows and columns centred as QwenEmbedRope's scale_rope
    numbers them (-ceil(n / 2) to n // 2 - 1); the image is frame 0, the Edit pipelines' input images 1, 2, ..."""
    r, c = np.meshgrid(np.arange(rows) - (rows - rows // 2), np.arange(cols) - (cols - cols // 2), indexing="ij")
    return np.stack([np.full_like(r, index), r, c], axis=-1).reshape(-1, 3).astype(np.float32)


def qwen_text(length: int, shapes) -> np.ndarray:
    """(length, 3) float32: Qwen-Image's text positions, on every axis after the largest half side of the images'
    token grids `shapes` ((rows, cols) each)."""
    first = max(max(rows // 2, cols // 2) for rows, cols in shapes)
    return np.repeat(np.arange(first, first + length, dtype=np.float32)[:, None], 3, axis=1)
