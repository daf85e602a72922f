"""Tiled VAE: run an engine on overlapping tiles of an input larger than the engine's range and
blend the overlaps, so that peak memory is one tile's whatever the image size.

This is diffusers' `AutoencoderKL.tiled_decode` / `_tiled_encode` in numpy, step for step
(tiles every `tile * (1 - overlap)`, linear blends over `overlap` of the output tile, blends
applied in place in the same order), so it can be checked against diffusers' own tiled result.
One difference: a tile at the far edge that is smaller than the engine's minimum is padded
(edge values repeated) to that minimum and its output cropped, where diffusers runs the small
tile as it is.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

OVERLAP = 0.25  # diffusers' tile_overlap_factor


def _blend_v(a: np.ndarray, b: np.ndarray, extent: int) -> np.ndarray:
    extent = min(a.shape[2], b.shape[2], extent)
    for y in range(extent):
        b[:, :, y, :] = a[:, :, -extent + y, :] * (1 - y / extent) + b[:, :, y, :] * (y / extent)
    return b


def _blend_h(a: np.ndarray, b: np.ndarray, extent: int) -> np.ndarray:
    extent = min(a.shape[3], b.shape[3], extent)
    for x in range(extent):
        b[:, :, :, x] = a[:, :, :, -extent + x] * (1 - x / extent) + b[:, :, :, x] * (x / extent)
    return b


def _run_padded(fn, tile: np.ndarray, min_side: int, scale: float) -> list[np.ndarray]:
    h, w = tile.shape[2:]
    if h >= min_side and w >= min_side:
        return fn(tile)
    padded = np.pad(tile, ((0, 0), (0, 0), (0, max(0, min_side - h)), (0, max(0, min_side - w))), mode="edge")
    return [o[:, :, : round(h * scale), : round(w * scale)] for o in fn(padded)]


def tiled(fn: Callable[[np.ndarray], list[np.ndarray]], x: np.ndarray, tile_in: int, scale: float,
          min_side: int = 1, overlap: float = OVERLAP) -> list[np.ndarray]:
    """Apply `fn` (NCHW in -> list of NCHW outputs `scale` times the size) tile by tile.

    `tile_in` is the tile side in input pixels (the engine's largest), `min_side` the engine's
    smallest input side."""
    tile_out = int(tile_in * scale)
    step, extent = int(tile_in * (1 - overlap)), int(tile_out * overlap)
    limit = tile_out - extent
    rows = [[_run_padded(fn, x[:, :, i:i + tile_in, j:j + tile_in], min_side, scale)
             for j in range(0, x.shape[3], step)] for i in range(0, x.shape[2], step)]
    results = []
    for k in range(len(rows[0][0])):  # each output of fn (the encoder has two: mean and log-variance)
        out_rows = []
        for i, row in enumerate(rows):
            out_row = []
            for j, outs in enumerate(row):
                t = outs[k]
                if i > 0:
                    t = _blend_v(rows[i - 1][j][k], t, extent)
                if j > 0:
                    t = _blend_h(row[j - 1][k], t, extent)
                out_row.append(t[:, :, :limit, :limit])
            out_rows.append(np.concatenate(out_row, axis=3))
        results.append(np.concatenate(out_rows, axis=2))
    return results
