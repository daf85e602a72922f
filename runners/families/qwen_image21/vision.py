"""Qwen3-VL's vision bookkeeping in numpy, for Qwen-Image 2.1's reference images: which of the learned position
grid's entries each patch reads and with what weights (transformers' get_vision_interpolation_indices_and_weights:
the grid resampled bilinearly, corners aligned, to the image's patch grid), and each patch's (row, column) for the
rotary embedding, both in the processor's patch order (each 2 x 2 block of patches consecutive). The tower's graph
(export/families/qwen_image21.py) takes them as inputs, with the images padded to one patch count."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


def _patch_rows_cols(rows: int, cols: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Each patch's row and column, in the processor's order: merged block by block, row-major inside a block."""
    k = np.arange(rows * cols)
    blocks_across = cols // merge
    row = (k // (merge * merge * blocks_across)) * merge + (k // merge) % merge
    col = ((k // (merge * merge)) % blocks_across) * merge + k % merge
    return row, col


def _taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """The two grid entries along one axis that patch `index` of `size` reads, and their weights (float32, as
    transformers computes them)."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    taps = np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
    weights = np.maximum(np.float32(1) - np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32)),
                         np.float32(0))
    return taps, weights


class PatchPositions(NamedTuple):
    indices: np.ndarray  # (patches, 4) int64: the grid entries (row-major in a side x side grid) a patch reads
    weights: np.ndarray  # (patches, 4) float32
    positions: np.ndarray  # (patches, 2) int64: row, column


def patch_positions(rows: int, cols: int, side: int, merge: int) -> PatchPositions:
    """The position-embedding taps and rotary positions of an image of `rows` x `cols` patches, for a learned grid
    of `side` x `side` entries."""
    row, col = _patch_rows_cols(rows, cols, merge)
    (row_taps, row_weights), (col_taps, col_weights) = _taps(row, rows, side), _taps(col, cols, side)
    indices = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
    weights = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)
    return PatchPositions(indices, weights.astype(np.float32), np.stack([row, col], -1).astype(np.int64))
