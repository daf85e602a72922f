"""Qwen2.5-VL's image path in numpy, for the Edit pipelines: what Qwen2VLProcessor's image processor computes
(`pixel_patches`: resized to a multiple of 28 within a pixel budget, normalised, cut into 14-pixel patches of
two identical frames, each 2 x 2 block of patches consecutive), how the vision tower's graph takes them
(`vision_layout`), and the language model's 3D rotary positions around the image tokens (`mrope_positions`,
transformers' get_rope_index).

The vision tower attends within windows of 4 x 4 merged patches in most layers and over each whole image in
the others; transformers reorders the patches window by window and slices its attention by lengths computed in
Python. The graph (export/families/qwen_image_edit.py) takes the patches already laid out window by window,
each window padded to its full size, with a segment per row (the image it belongs to, -1 for padding): its
window layers attend within fixed blocks of rows, its full layers within a segment, and nothing is indexed in
the graph. `merged_in_order` puts the tower's merged tokens back in the processor's order."""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

# OPENAI_CLIP_MEAN and OPENAI_CLIP_STD, Qwen2VLImageProcessor's defaults
MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)


class VisionConfig(NamedTuple):
    """The image processor's and the vision tower's numbers (the manifest's runtime constants)."""
    patch: int = 14
    merge: int = 2
    temporal: int = 2
    window: int = 112  # pixels a window side covers (Qwen2.5-VL's; Qwen3-VL's tower has no windows)
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    mean: tuple = MEAN  # the image processor's normalisation (Qwen3-VL's: 0.5, 0.5)
    std: tuple = STD

    @property
    def window_units(self) -> int:
        """Merged patches along a window's side (transformers' vit_merger_window_size)."""
        return self.window // self.merge // self.patch


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2VLImageProcessor's target size: sides multiples of `factor`, the area within the budget."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"an image of {width}x{height} pixels: Qwen2.5-VL takes aspect ratios up to 200:1")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def pixel_patches(image, config: VisionConfig) -> tuple[np.ndarray, tuple[int, int]]:
    """A PIL image -> (patches (rows * cols, 3 * temporal * patch * patch) float32, (rows, cols) of patches),
    as Qwen2VLProcessor's image processor (PIL backend) makes its pixel_values and image_grid_thw."""
    from PIL import Image

    image = image.convert("RGB")
    h, w = smart_resize(image.height, image.width, config.patch * config.merge, config.min_pixels, config.max_pixels)
    pixels = np.asarray(image.resize((w, h), Image.Resampling.BICUBIC)).transpose(2, 0, 1)
    pixels = (pixels.astype(np.float64) * (1 / 255)).astype(np.float32)  # transformers' rescale
    mean, std = (np.array(v, np.float32)[:, None, None] for v in (config.mean, config.std))
    pixels = (pixels - mean) / std
    p, m = config.patch, config.merge
    rows, cols = h // p, w // p
    patches = pixels.reshape(3, rows // m, m, p, cols // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], config.temporal, p, p))
    return patches.reshape(rows * cols, -1).astype(np.float32), (rows, cols)


class VisionLayout(NamedTuple):
    """The vision tower's graph inputs for some images, and where its merged tokens go back."""
    pixel_values: np.ndarray  # (windows * window rows, patch values)
    positions: np.ndarray  # (rows, 2) int64: each patch's row and column in its image
    segments: np.ndarray  # (rows,) int64: the image of each row, -1 on padding
    order: np.ndarray  # (merged tokens,) int64: the merged row (rows / merge**2) of each token in processor order


def vision_layout(images: list[tuple[np.ndarray, tuple[int, int]]], config: VisionConfig) -> VisionLayout:
    """`pixel_patches` of each image, laid out window by window (each window's merged patches row by row, padded
    to the window's full size), as transformers' get_vision_window_index orders them."""
    m, units = config.merge, config.window_units
    unit_rows = m * m
    values, positions, segments, order = [], [], [], []
    merged_rows = first_token = 0  # merged rows laid out so far; tokens of the earlier images
    for index, (patches, (rows, cols)) in enumerate(images):
        grid_r, grid_c = rows // m, cols // m
        # each patch's position, in the processor's order (merged unit by unit, 2 x 2 patches each)
        r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
        pos = np.stack([r, c], -1).reshape(grid_r, m, grid_c, m, 2).transpose(0, 2, 1, 3, 4).reshape(-1, 2)
        for wr in range(0, grid_r, units):
            for wc in range(0, grid_c, units):
                unit = (np.arange(wr, min(wr + units, grid_r))[:, None] * grid_c
                        + np.arange(wc, min(wc + units, grid_c))[None, :]).reshape(-1)
                patch = (unit[:, None] * unit_rows + np.arange(unit_rows)).reshape(-1)
                pad = units * units * unit_rows - len(patch)
                values.append(np.pad(patches[patch], ((0, pad), (0, 0))))
                positions.append(np.pad(pos[patch], ((0, pad), (0, 0))))
                segments.append(np.pad(np.full(len(patch), index), (0, pad), constant_values=-1))
                order.append(np.stack([first_token + unit, merged_rows + np.arange(len(unit))], -1))
                merged_rows += units * units
        first_token += grid_r * grid_c
    order = np.concatenate(order)
    return VisionLayout(np.concatenate(values).astype(np.float32), np.concatenate(positions).astype(np.int64),
                        np.concatenate(segments).astype(np.int64), order[np.argsort(order[:, 0]), 1])


def merged_in_order(merged: np.ndarray, layout: VisionLayout) -> np.ndarray:
    """The tower's merged tokens (window order, padding included) -> (tokens, width) in the processor's order:
    image by image, row by row, the rows the language model's image tokens take."""
    return merged[layout.order]


def image_tokens(grid: tuple[int, int], config: VisionConfig) -> int:
    """The language model's tokens for an image of `grid` patches (one <|image_pad|> each)."""
    return grid[0] * grid[1] // config.merge**2


def mrope_positions(ids: np.ndarray, mask: np.ndarray, image_token: int, grids: list[tuple[int, int]],
                    config: VisionConfig) -> np.ndarray:
    """(3, prompts, length) int64: Qwen2.5-VL's rotary positions (time, row, column) for token `ids` whose image
    tokens are the images of `grids`, in order, in every prompt: text tokens count up on all three axes; an
    image's tokens share its start on the time axis and count rows and columns from it; the text after goes on
    from its largest side. Padding (mask 0) takes 0 (transformers' get_rope_index)."""
    out = np.zeros((3, *ids.shape), dtype=np.int64)
    for b, (row, keep) in enumerate(zip(ids, mask.astype(bool))):
        tokens = row[keep]
        pos, start, i, image = [], 0, 0, 0
        while i < len(tokens):
            if tokens[i] != image_token:
                j = i
                while j < len(tokens) and tokens[j] != image_token:
                    j += 1
                pos.append(np.repeat(np.arange(start, start + j - i)[None], 3, axis=0))
                start += j - i
            else:
                rows, cols = (g // config.merge for g in grids[image])
                r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
                pos.append(np.stack([np.zeros(rows * cols, np.int64), r.reshape(-1), c.reshape(-1)]) + start)
                j, image, start = i + rows * cols, image + 1, start + max(rows, cols)
            i = j
        out[:, b, keep] = np.concatenate(pos, axis=1)
    return out
