"""The U-Net family runners against diffusers' StableDiffusionPipeline and
StableDiffusionXLPipeline: same weights, same latents, fp32, their default schedulers (PNDM and
Euler). Images must agree to within 1/255."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import assert_real_image
from runners import Pipeline

ONE_LEVEL = 1 / 255
CASES = {
    "square": dict(prompt="a photo of a cat", height=128, width=128),
    "non_square": dict(prompt="a castle in the rain", height=64, width=128),
    "negative_prompt_two_per_prompt": dict(prompt="a dragon", negative_prompt="blurry, dark", num_images_per_prompt=2,
                                           height=64, width=64),
    "two_prompts_empty_negative": dict(prompt=["a cat", "a dog"], negative_prompt=["", "ugly"], height=64, width=64),
    "no_guidance": dict(prompt="an astronaut", guidance_scale=1.0, height=128, width=64),
}
SDXL_CASES = {
    **CASES,
    "micro_conditions": dict(prompt="a red fox", height=64, width=64, original_size=(512, 384),
                             crops_coords_top_left=(16, 32), target_size=(256, 256)),
}


def _latents(case: dict, seed: int) -> np.ndarray:
    n = (1 if isinstance(case["prompt"], str) else len(case["prompt"])) * case.get("num_images_per_prompt", 1)
    return np.random.default_rng(seed).standard_normal((n, 4, case["height"] // 8, case["width"] // 8),
                                                       dtype=np.float32)


def _compare(pipe, reference, case: dict, seed: int):
    kwargs = dict(case, num_inference_steps=5)
    latents = _latents(kwargs, seed)
    ours = pipe(latents=latents, output_type="np", **kwargs)
    ref = reference(latents=torch.from_numpy(latents), output_type="np", **kwargs).images
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= ONE_LEVEL, np.abs(ours - ref).max()
    assert_real_image(ref)  # not a constant or saturated image the test could not tell apart


@pytest.fixture(scope="module")
def sd15(sd15_tiny_build):
    from diffusers import StableDiffusionPipeline

    reference = StableDiffusionPipeline.from_pretrained(sd15_tiny_build.source.folder)
    reference.set_progress_bar_config(disable=True)
    return Pipeline.load(sd15_tiny_build.folder / "ort-fp32"), reference


@pytest.fixture(scope="module")
def sdxl(sdxl_tiny_build):
    from diffusers import StableDiffusionXLPipeline

    reference = StableDiffusionXLPipeline.from_pretrained(sdxl_tiny_build.source.folder)
    reference.set_progress_bar_config(disable=True)
    return Pipeline.load(sdxl_tiny_build.folder / "ort-fp32"), reference


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_sd15_matches_diffusers(sd15, case):
    assert type(sd15[0]).__name__ == "SD15Pipeline" and sd15[0].scheduler.__class__.__name__ == "PNDM"
    _compare(*sd15, CASES[case], seed=len(case))


@pytest.mark.parametrize("case", SDXL_CASES, ids=list(SDXL_CASES))
def test_sdxl_matches_diffusers(sdxl, case):
    assert type(sdxl[0]).__name__ == "SDXLPipeline" and sdxl[0].scheduler.__class__.__name__ == "EulerDiscrete"
    _compare(*sdxl, SDXL_CASES[case], seed=len(case))


def test_sd15_with_ddim_and_euler_configs(sd15, tmp_path):
    """The other schedulers SD1.5 is run with: the runner follows the artifact's scheduler config."""
    from diffusers import DDIMScheduler, EulerDiscreteScheduler

    from runners.schedulers import load_scheduler

    pipe, reference = sd15
    defaults = pipe.scheduler, reference.scheduler
    try:
        for cls in (DDIMScheduler, EulerDiscreteScheduler):
            reference.scheduler = cls.from_config(reference.scheduler.config)
            pipe.scheduler = load_scheduler(dict(reference.scheduler.config, _class_name=cls.__name__))
            _compare(pipe, reference, CASES["square"], seed=3)
    finally:
        pipe.scheduler, reference.scheduler = defaults


def test_sizes_off_the_unet_multiple_are_refused(sd15, sdxl):
    with pytest.raises(ValueError, match="height=96 is not allowed: use a multiple of 64"):
        sd15[0]("a cat", height=96, width=64, num_inference_steps=1)
    with pytest.raises(ValueError, match="width=80 is not allowed: use a multiple of 32"):
        sdxl[0]("a cat", height=64, width=80, num_inference_steps=1)
    with pytest.raises(ValueError, match="original_size, crops_coords_top_left and target_size"):
        sdxl[0]("a cat", height=64, width=64, num_inference_steps=1, original_size=(64,))
