"""Image to image against diffusers' Img2Img pipelines: same weights, the same image, and the same
`noise` and `encoder_noise` handed to both (diffusers' randn_tensor patched), fp32. Images must agree
to within 1/255."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import diffusers.models.autoencoders.vae as diffusers_vae
from conftest import assert_real_image
from runners import Pipeline

ONE_LEVEL = 1 / 255


def _image(height: int, width: int, seed: int = 0):
    """A smooth RGB picture (a random image would be mostly noise to the VAE)."""
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    phase = np.random.default_rng(seed).uniform(0, 6, 3)
    rgb = np.stack([0.5 + 0.45 * np.sin(6 * x + 4 * y + p) for p in phase], axis=-1)
    return Image.fromarray((rgb * 255).round().astype(np.uint8))


def _noises(n_images: int, n_given: int, height: int, width: int, channels: int, seed: int):
    rng = np.random.default_rng(seed)
    latent = (channels, height // 8, width // 8)
    return rng.standard_normal((n_given, *latent), dtype=np.float32), \
        rng.standard_normal((n_images, *latent), dtype=np.float32)


def _patched_reference(monkeypatch, module, noise, encoder_noise):
    monkeypatch.setattr(diffusers_vae, "randn_tensor", lambda shape, **kw: torch.from_numpy(encoder_noise))
    monkeypatch.setattr(module, "randn_tensor", lambda shape, **kw: torch.from_numpy(noise))


SD3_CASES = {
    "strength_0.3": dict(strength=0.3, height=128, width=128),
    "strength_0.6": dict(strength=0.6, height=128, width=128),
    "strength_1.0": dict(strength=1.0, height=128, width=128),
    "non_square": dict(strength=0.6, height=80, width=144),
    "no_guidance": dict(strength=0.6, height=96, width=96, guidance_scale=1.0),
    "two_per_prompt": dict(strength=0.6, height=64, width=64, num_images_per_prompt=2, negative_prompt="blurry"),
}


@pytest.fixture(scope="module")
def sd3_img2img(tiny_source):
    from diffusers import StableDiffusion3Img2ImgPipeline

    pipe = StableDiffusion3Img2ImgPipeline.from_pretrained(tiny_source.folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("case", SD3_CASES)
def test_sd3_image_to_image_matches_diffusers(monkeypatch, tiny_artifact, sd3_img2img, case):
    import diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3_img2img as module

    kwargs = dict(SD3_CASES[case], prompt="a photo of a cat", num_inference_steps=6, max_sequence_length=64)
    image = _image(kwargs["height"] + 13, kwargs["width"] - 7, seed=len(case))  # resized to the size asked for
    n = kwargs.get("num_images_per_prompt", 1)
    encoder_noise, noise = _noises(n, 1, kwargs["height"], kwargs["width"], 16, seed=len(case))
    _patched_reference(monkeypatch, module, noise, encoder_noise)
    ref = sd3_img2img(image=image, output_type="np", **kwargs).images
    ours = Pipeline.load(tiny_artifact)(image=image, noise=noise, encoder_noise=encoder_noise, output_type="np",
                                        **kwargs)
    assert ours.shape == ref.shape == (n, kwargs["height"], kwargs["width"], 3)
    assert np.abs(ours - ref).max() <= ONE_LEVEL
    assert_real_image(ref)
