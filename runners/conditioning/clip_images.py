"""Images for a CLIP vision encoder, as transformers' CLIPImageProcessor prepares them (its PIL backend, which it
uses where torchvision is not installed), without transformers: RGB, the shortest side resized to the processor's
size (bicubic by default), a centre crop, values rescaled to [0, 1] and normalised by CLIP's mean and std. The
settings are the folder's preprocessor_config.json, recorded in the manifest at export."""
from __future__ import annotations

import numpy as np

from runners.conditioning.images import _as_list


def _resized(image, shortest: int, resample: int):
    """transformers' get_resize_output_image_size (default_to_square False): the short side to `shortest`, the
    long side in proportion, rounded down."""
    w, h = image.size
    short, long = (w, h) if w <= h else (h, w)
    new_long = int(shortest * long / short)
    return image.resize((shortest, new_long) if w <= h else (new_long, shortest), resample=resample)


def _cropped(array: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' center_crop on (H, W, C) at least the crop's size: the top-left corner at half the excess,
    rounded down."""
    top, left = (array.shape[0] - height) // 2, (array.shape[1] - width) // 2
    return array[top:top + height, left:left + width]


def clip_pixel_values(value, settings: dict) -> np.ndarray:
    """An image argument (a PIL image, a numpy (H, W, 3) in [0, 1], or a list of them) -> pixel_values
    (N, 3, crop height, crop width) float32. A numpy image is taken as the 8-bit picture it rounds to."""
    from PIL import Image

    images = [i if isinstance(i, Image.Image) else Image.fromarray((np.asarray(i) * 255).round().astype(np.uint8))
              for i in _as_list("image", value)]
    crop = settings["crop_size"]
    mean, std = (np.asarray(settings[k], dtype=np.float32) for k in ("image_mean", "image_std"))
    out = []
    for image in images:
        array = np.asarray(_resized(image.convert("RGB"), settings["size"]["shortest_edge"], settings["resample"]))
        array = _cropped(array, crop["height"], crop["width"])
        array = (array.astype(np.float64) * settings["rescale_factor"]).astype(np.float32)
        out.append(((array - mean) / std).transpose(2, 0, 1))
    return np.stack(out)
