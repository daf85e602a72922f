"""Image to image and inpainting against diffusers' Img2Img and Inpaint pipelines: same weights, the
same image and mask, and the same `noise` and `encoder_noise` handed to both (diffusers' randn_tensor
patched: the VAE's posterior samples all get `encoder_noise`), fp32. Images must agree to within
1e-4: the errors measured are at most 5e-5 (SD3 inpainting), far inside the 1/255 of an image level."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import diffusers.models.autoencoders.vae as diffusers_vae
from conftest import assert_real_image, soft_mask as _mask, smooth_image as _image
from runners import Pipeline

BOUND = 1e-4  # of [0, 1] image values; measured: up to 4.8e-5 (SD3 inpainting, two per prompt)


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
    print(f"max abs error {np.abs(ours - ref).max():.1e}")
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
    print(f"max abs error {np.abs(ours - ref).max():.1e}")
    assert np.abs(ours - ref).max() <= BOUND, np.abs(ours - ref).max()
    assert_real_image(ref)


INPAINT_CASES = {  # (family, model's build fixture): cases
    ("sd3", "sd3_tiny_build"): {
        "strength_0.6": dict(strength=0.6),
        "strength_1.0_non_square": dict(strength=1.0, size=(80, 144)),
        "no_guidance_two_per_prompt": dict(strength=0.8, guidance_scale=1.0, num_images_per_prompt=2),
    },
    ("sd15", "sd15_tiny_build"): {  # the 4-channel UNet: the known part blended back after each step
        "strength_0.75": dict(strength=0.75),
        "strength_1.0_two_per_prompt": dict(strength=1.0, num_images_per_prompt=2, negative_prompt="blurry"),
    },
    ("sd15", "sd15_inpaint_tiny_build"): {  # the 9-channel UNet: the mask and masked image as its input
        "strength_1.0": dict(strength=1.0),
        "strength_0.6_non_square_no_guidance": dict(strength=0.6, size=(64, 128), guidance_scale=1.0),
    },
    ("sdxl", "sdxl_tiny_build"): {
        "default_strength": dict(),  # 0.9999: the image's latents noised, not pure noise
        "strength_0.5_two_per_prompt": dict(strength=0.5, num_images_per_prompt=2),
    },
}
_INPAINT_PIPELINES = {"sd3": ("StableDiffusion3InpaintPipeline", "stable_diffusion_3.pipeline_stable_diffusion_3_inpaint"),
                      "sd15": ("StableDiffusionInpaintPipeline", "stable_diffusion.pipeline_stable_diffusion_inpaint"),
                      "sdxl": ("StableDiffusionXLInpaintPipeline",
                               "stable_diffusion_xl.pipeline_stable_diffusion_xl_inpaint")}


@pytest.fixture(scope="module")
def inpaint_references(request):
    """Each build's diffusers Inpaint pipeline, loaded once: {(family, fixture): (build folder, pipeline)}."""
    import importlib

    import diffusers

    loaded = {}

    def get(family, fixture):
        if fixture not in loaded:
            build = request.getfixturevalue(fixture)
            reference = getattr(diffusers, _INPAINT_PIPELINES[family][0]).from_pretrained(build.source.folder)
            reference.set_progress_bar_config(disable=True)
            loaded[fixture] = build.folder, reference
        module = importlib.import_module(f"diffusers.pipelines.{_INPAINT_PIPELINES[family][1]}")
        return (*loaded[fixture], module)

    return get


@pytest.mark.parametrize("family, fixture, case", [(f, b, c) for (f, b), cases in INPAINT_CASES.items() for c in cases])
def test_inpainting_matches_diffusers(monkeypatch, inpaint_references, family, fixture, case):
    """Every family at its model's default size or another, both kinds of denoiser, strengths below
    and at 1 (pure noise), with and without guidance, and two images per prompt."""
    folder, reference, module = inpaint_references(family, fixture)
    kwargs = dict(INPAINT_CASES[family, fixture][case], prompt="a photo of a cat", num_inference_steps=5)
    height, width = kwargs.pop("size", (128, 128))
    image, mask = _image(height, width, seed=len(case)), _mask(height, width)
    n = kwargs.get("num_images_per_prompt", 1)
    encoder_noise, noise = _noises(n, 1, height, width, 16 if family == "sd3" else 4, seed=len(case))
    _patched_reference(monkeypatch, module, noise, encoder_noise)
    ref = reference(image=image, mask_image=mask, height=height, width=width, output_type="np", **kwargs).images
    ours = Pipeline.load(folder / "ort-fp32")(image=image, mask_image=mask, height=height, width=width,
                                              noise=noise, encoder_noise=encoder_noise, output_type="np", **kwargs)
    assert ours.shape == ref.shape == (n, height, width, 3)
    print(f"max abs error {np.abs(ours - ref).max():.1e}")
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
    (dict(image=None, mask_image=_mask(128, 128)), "mask_image= needs image= too"),
    (dict(mask_image=_mask(64, 96)), r"mask_image is 64x96 but image is 128x128 \(height x width\)"),
    (dict(image=np.full((128, 128, 3), 0.5), mask_image=np.ones((128, 64))), "mask_image is 128x64 but image is "
                                                                             "128x128"),
    (dict(mask_image=[_mask(128, 128)] * 2), "2 masks for 1 images: pass one mask, or one per image"),
    (dict(mask_image=_mask(128, 128), latents=np.zeros((1, 16, 16, 16), np.float32)),
     "latents= are text to image's starting latents; inpainting starts from the image"),
])
def test_bad_image_to_image_requests_are_refused(tiny_artifact, kwargs, said):
    request = {**dict(prompt="a cat", image=_image(128, 128), num_inference_steps=2, seed=0), **kwargs}
    with pytest.raises(ValueError, match=said):
        Pipeline.load(tiny_artifact)(**request)


def test_image_to_image_arguments_need_an_image(tiny_artifact):
    with pytest.raises(ValueError, match="strength, noise are image to image's: pass image= too"):
        Pipeline.load(tiny_artifact)("a cat", strength=0.5, noise=np.zeros(1), num_inference_steps=1)


@pytest.mark.parametrize("kwargs", [dict(), dict(image=_image(64, 64))])
def test_an_inpainting_unet_needs_a_mask(sd15_inpaint_tiny_build, kwargs):
    with pytest.raises(ValueError, match=r"this artifact's unet is an inpainting one \(9 input channels: .*pass "
                                         "image= and mask_image="):
        Pipeline.load(sd15_inpaint_tiny_build.folder / "ort-fp32")("a cat", num_inference_steps=1, **kwargs)


@pytest.mark.parametrize("size", [(520, 128), (136, 128)], ids=["larger_than_the_engines", "not_a_whole_multiple"])
def test_an_image_size_the_engines_cannot_take_is_refused_with_their_range(sd15_tiny_build, size):
    """SD1.5 and SDXL take the image's own size: past the engines' range (or off the UNet's multiple),
    the image is refused before any engine runs, saying the range and how to resize it."""
    pipe = Pipeline.load(sd15_tiny_build.folder / "ort-fp32")
    said = (rf"the image is {size[0]}x{size[1]} \(its size, rounded down to a multiple of 8\); its height must be "
            r"a multiple of 64 from 64 to 256 .*: pass height= and width= \(--height/--width\) to resize it")
    with pytest.raises(ValueError, match=said):
        pipe("a cat", image=_image(*size), num_inference_steps=2)
    assert pipe.timings == {}


def test_a_strength_that_runs_no_step_is_refused(sd15_tiny_build):
    """SD1.5 and SDXL round the steps they keep down (4 x 0.1 keeps none), as diffusers does; SD3 keeps one."""
    with pytest.raises(ValueError, match="strength=0.1 with num_inference_steps=4 runs no step"):
        Pipeline.load(sd15_tiny_build.folder / "ort-fp32")("a cat", image=_image(64, 64), strength=0.1,
                                                           num_inference_steps=4)


@pytest.fixture(scope="module")
def sdxl_aesthetic_build(tmp_path_factory, shared_root, sdxl_tiny_build):
    """sdxl-tiny with a UNet trained on aesthetic scores (five time ids, as SDXL's refiner), saved as a
    StableDiffusionXLInpaintPipeline that requires them, then exported from its folder as a user's is (its
    two text encoders and its VAE, sdxl-tiny's, taken from that export)."""
    from engines.api import build_artifact
    from export.api import export_model
    from export.families.sdxl import build_sdxl
    from export.registry import SDXL_TINY
    from export.source import resolve

    unet = SDXL_TINY["unet"]
    configs = {**SDXL_TINY, "pipeline_class": "StableDiffusionXLInpaintPipeline",
               "pipeline_kwargs": {"requires_aesthetics_score": True},
               "unet": {**unet, "projection_class_embeddings_input_dim": unet[
                   "projection_class_embeddings_input_dim"] - unet["addition_time_embed_dim"]}}
    folder, build = tmp_path_factory.mktemp("sdxl-aesthetic-model"), tmp_path_factory.mktemp("sdxl-aesthetic")
    build_sdxl(configs, folder)
    export_model(resolve(str(folder)), build, image_size=(64, 128, 256), reuse_from=shared_root)
    return folder, build_artifact(build, "ort", "fp32")


def test_sdxl_aesthetic_scores_match_diffusers(monkeypatch, sdxl_aesthetic_build):
    """Inpainting with guidance: the score in the conditional half, the negative one in the other.
    (Image to image builds its time ids with the same code.)"""
    from diffusers import StableDiffusionXLInpaintPipeline
    import diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl_inpaint as module

    folder, artifact = sdxl_aesthetic_build
    reference = StableDiffusionXLInpaintPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    kwargs = dict(prompt="a photo of a cat", image=_image(128, 128), mask_image=_mask(128, 128), height=128,
                  width=128, num_inference_steps=4, strength=0.75, aesthetic_score=7.0, negative_aesthetic_score=2.0)
    encoder_noise, noise = _noises(1, 1, 128, 128, 4, seed=5)
    _patched_reference(monkeypatch, module, noise, encoder_noise)
    ref = reference(output_type="np", **kwargs).images
    pipe = Pipeline.load(artifact)
    assert pipe.manifest["constants"]["time_ids"] == 5
    ours = pipe(noise=noise, encoder_noise=encoder_noise, output_type="np", **kwargs)
    print(f"max abs error {np.abs(ours - ref).max():.1e}")
    assert np.abs(ours - ref).max() <= BOUND, np.abs(ours - ref).max()
    assert_real_image(ref)
