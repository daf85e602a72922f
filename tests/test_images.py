"""Image and mask preparation against diffusers' VaeImageProcessor, exactly: PIL and numpy inputs,
their own size rounded down or a requested size, lists, and alpha/grayscale images converted."""
from __future__ import annotations

import numpy as np
import pytest
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from runners.conditioning.images import to_model_input

SCALE = 8


def _pil(seed: int, size=(77, 53), mode="RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)


@pytest.mark.parametrize("size", [(None, None), (64, 48), (48, 96)])
@pytest.mark.parametrize("kind", ["pil", "numpy", "list"])
def test_images_match_diffusers(size, kind):
    processor = VaeImageProcessor(vae_scale_factor=SCALE)
    images = {"pil": _pil(0), "numpy": np.asarray(_pil(0), dtype=np.float32) / 255,
              "list": [_pil(1), _pil(2)]}[kind]
    ours = to_model_input(images, *size, multiple=SCALE)
    ref = processor.preprocess(images, *size).numpy()
    assert ours.shape == ref.shape and ours.dtype == np.float32
    assert np.array_equal(ours, ref)
    if size == (None, None):
        assert ours.shape[2:] == (48, 72)  # 53x77 rounded down to multiples of 8


@pytest.mark.parametrize("mode", ["RGB", "L"])
@pytest.mark.parametrize("size", [(None, None), (64, 48)])
def test_masks_match_diffusers(mode, size):
    processor = VaeImageProcessor(vae_scale_factor=SCALE, do_normalize=False, do_binarize=True,
                                  do_convert_grayscale=True)
    mask = _pil(3, mode=mode)
    ours = to_model_input(mask, *size, multiple=SCALE, mask=True)
    assert np.array_equal(ours, processor.preprocess(mask, *size).numpy())
    assert set(np.unique(ours)) == {0.0, 1.0} and ours.shape[1] == 1
    gray = np.asarray(mask.convert("L"), dtype=np.float32) / 255
    assert np.array_equal(to_model_input(gray, *size, multiple=SCALE, mask=True),
                          processor.preprocess(gray[None], *size).numpy())


def test_alpha_and_grayscale_images_are_converted_to_rgb():
    for mode in ("RGBA", "L"):
        image = _pil(4, mode=mode)
        assert np.array_equal(to_model_input(image, None, None, SCALE),
                              to_model_input(image.convert("RGB"), None, None, SCALE))


@pytest.mark.parametrize("value, said", [
    ("in.png", "image must be a PIL image, a numpy array .* got str"),
    ([], "image must be .* got list"),
    (np.zeros((8, 8)), r"a numpy image is \(H, W, 3\) or \(N, H, W, 3\) .* got shape \(8, 8\)"),
    (np.zeros((8, 8, 4)), r"got shape \(8, 8, 4\)"),
])
def test_bad_images_are_refused(value, said):
    with pytest.raises(ValueError, match=said):
        to_model_input(value, None, None, SCALE)
