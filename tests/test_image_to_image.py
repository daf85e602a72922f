"""Image to image against diffusers' Img2Img pipelines: same weights, the same image, and the same
`noise` and `encoder_noise` handed to both (diffusers' randn_tensor patched), fp32. Images must agree
to within 1e-4: the errors measured are at most 7e-6, far inside the 1/255 of an image level."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import diffusers.models.autoencoders.vae as diffusers_vae
from conftest import assert_real_image
from runners import Pipeline

BOUND = 1e-4  # of [0, 1] image values; measured: up to 7e-6 (SDXL)


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
    assert np.abs(ours - ref).max() <= BOUND
    assert_real_image(ref)


UNET_CASES = {
    "strength_0.5": dict(strength=0.5),
    "non_square_two_per_prompt": dict(strength=0.7, num_images_per_prompt=2, negative_prompt="blurry", size=(64, 128)),
    "no_guidance": dict(strength=0.6, guidance_scale=1.0),
}


@pytest.fixture(scope="module")
def unet_references(request):
    """Each family's diffusers Img2Img pipeline, loaded once: {family: (build, pipeline)}."""
    from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionXLImg2ImgPipeline

    loaded = {}

    def get(family):
        if family not in loaded:
            build = request.getfixturevalue(f"{family}_tiny_build")
            cls = {"sd15": StableDiffusionImg2ImgPipeline, "sdxl": StableDiffusionXLImg2ImgPipeline}[family]
            reference = cls.from_pretrained(build.source.folder)
            reference.set_progress_bar_config(disable=True)
            loaded[family] = build, reference
        return loaded[family]

    return get


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
@pytest.mark.parametrize("case", UNET_CASES)
def test_unet_image_to_image_matches_diffusers(monkeypatch, unet_references, family, case):
    """SD1.5 (PNDM: add_noise at a DDPM timestep) and SDXL (Euler: add_noise at a sigma). Both take
    the image's own size, as their Img2Img pipelines do."""
    import diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img as sd15_module
    import diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl_img2img as sdxl_module

    build, reference = unet_references(family)
    module = {"sd15": sd15_module, "sdxl": sdxl_module}[family]
    kwargs = dict(UNET_CASES[case], prompt="a photo of a cat", num_inference_steps=5)
    height, width = kwargs.pop("size", (128, 128))
    image = _image(height, width, seed=len(case))
    n = kwargs.get("num_images_per_prompt", 1)
    encoder_noise, noise = _noises(n, 1, height, width, 4, seed=len(case))
    _patched_reference(monkeypatch, module, noise, encoder_noise)
    ref = reference(image=image, output_type="np", **kwargs).images
    ours = Pipeline.load(build.folder / "ort-fp32")(image=image, noise=noise, encoder_noise=encoder_noise,
                                                    output_type="np", **kwargs)
    assert ours.shape == ref.shape == (n, height, width, 3)
    assert np.abs(ours - ref).max() <= BOUND, np.abs(ours - ref).max()
    assert_real_image(ref)


@pytest.mark.parametrize("kwargs, said", [
    (dict(strength=0.0), r"strength=0.0 is not allowed: use a number in \(0, 1\]"),
    (dict(strength=1.5), r"strength=1.5 is not allowed"),
    (dict(latents=np.zeros((1, 16, 16, 16), np.float32)), "latents= are text to image's starting latents"),
    (dict(noise=np.zeros((1, 16, 8, 8), np.float32)), r"noise have shape \(1, 16, 8, 8\); this request needs "
                                                      r"\(1, 16, 16, 16\)"),
    (dict(image=[_image(128, 128), _image(128, 128), _image(128, 128)], prompt=["a", "b"]),
     "3 images cannot be shared by the 2 images to generate"),
    (dict(image="cat.png"), "image must be a PIL image, a numpy array .* got str"),
])
def test_bad_image_to_image_requests_are_refused(tiny_artifact, kwargs, said):
    request = {**dict(prompt="a cat", image=_image(128, 128), num_inference_steps=2, seed=0), **kwargs}
    with pytest.raises(ValueError, match=said):
        Pipeline.load(tiny_artifact)(**request)


def test_image_to_image_arguments_need_an_image(tiny_artifact):
    with pytest.raises(ValueError, match="strength, noise are image to image's: pass image= too"):
        Pipeline.load(tiny_artifact)("a cat", strength=0.5, noise=np.zeros(1), num_inference_steps=1)


def test_a_strength_that_runs_no_step_is_refused(sd15_tiny_build):
    """SD1.5 and SDXL round the steps they keep down (4 x 0.1 keeps none), as diffusers does; SD3 keeps one."""
    with pytest.raises(ValueError, match="strength=0.1 with num_inference_steps=4 runs no step"):
        Pipeline.load(sd15_tiny_build.folder / "ort-fp32")("a cat", image=_image(64, 64), strength=0.1,
                                                           num_inference_steps=4)
