"""Qwen-Image (export/families/qwen_image.py, runners/families/qwen_image/) against diffusers' QwenImagePipeline
and its Img2Img and Inpaint twins on qwen-image-tiny. One export and one ort-fp32 build."""
from __future__ import annotations

import numpy as np
import pytest
import torch

# Measured: at most 1e-6 (images in [0, 1]) over the cases below; 1/255 is 3.9e-3.
IMAGE_ATOL = 5e-5


@pytest.fixture(scope="module")
def pair(qwen_image_tiny_build):
    from conftest import ours_and_diffusers

    return ours_and_diffusers(qwen_image_tiny_build, "QwenImagePipeline")


def packed_noise(n: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """Latents as QwenImagePipeline takes them: (n, tokens, 64), 2 x 2 patches of the 16-channel latents."""
    from runners.families.flux.conditions import pack

    return pack(np.random.default_rng(seed).standard_normal((n, 16, height // 8, width // 8), dtype=np.float32))


@pytest.fixture(scope="module")
def run_both(pair):
    ours, reference = pair
    cache = {}

    def run(prompt, height=64, width=64, steps=3, per_prompt=1, **options):
        key = repr((prompt, height, width, steps, per_prompt, sorted(options.items())))
        if key not in cache:
            n = (len(prompt) if isinstance(prompt, list) else 1) * per_prompt
            latents = packed_noise(n, height, width)
            common = dict(height=height, width=width, num_inference_steps=steps, output_type="np",
                          num_images_per_prompt=per_prompt)
            with torch.no_grad():
                theirs = reference(prompt=prompt, latents=torch.from_numpy(latents), **common, **options).images
            cache[key] = (ours(prompt, latents=latents, **common, **options), theirs)
        return cache[key]
    return run


CFG = dict(negative_prompt="blurry, dark", true_cfg_scale=4.0)
CASES = {  # name: (arguments, the case whose image it must change)
    "no negative prompt": (dict(prompt="a red cat"), None),
    "true cfg": (dict(prompt="a red cat", **CFG), "no negative prompt"),
    "true cfg 8": (dict(prompt="a red cat", negative_prompt="blurry, dark", true_cfg_scale=8.0), "true cfg"),
    "two lengths": (dict(prompt=["a red cat", "a golden dragon on the moon at sunset, misty light, detailed"]), None),
    "non-square": (dict(prompt="a red cat", width=128), None),
    "tall": (dict(prompt="a red cat", height=128, **CFG), None),
    "one prompt, two per prompt": (dict(prompt="a cat", per_prompt=2, negative_prompt="blurry"), None),
    "long prompt": (dict(prompt="a golden dragon on the moon at sunset, misty light"), None),
    "max_sequence_length": (dict(prompt="a golden dragon on the moon at sunset, misty light", max_sequence_length=4),
                            "long prompt"),
}


@pytest.mark.parametrize("case", CASES)
def test_equal_to_diffusers(run_both, case):
    from conftest import assert_real_image

    arguments, changes = CASES[case]
    ours, theirs = run_both(**arguments)
    assert_real_image(theirs)
    assert ours.shape == theirs.shape
    error = float(np.abs(ours - theirs).max())
    print(f"qwen-image {case}: |ours - diffusers| {error:.1e}")
    assert error <= IMAGE_ATOL
    if changes:  # the feature did something
        assert np.abs(ours - run_both(**CASES[changes][0])[0]).max() > 0.01


def test_two_prompts_two_images_each_as_the_prompts_repeated(pair):
    """Two prompts of different lengths, two images each, with guidance: diffusers repeats the states p0, p0, p1,
    p1 but their masks p0, p1, p0, p1 (diffusers #13581, fixed by #14147), so its images 2 and 3 read the other
    prompt's mask. Ours pairs each prompt with its own mask: equal to diffusers given the prompts repeated."""
    from conftest import assert_real_image

    ours, reference = pair
    prompts, negatives = ["a cat", "a very long dog in a garden"], ["blurry", "dark and noisy"]
    latents = packed_noise(4, 64, 64)
    call = dict(height=64, width=64, num_inference_steps=3, output_type="np", true_cfg_scale=3.0)
    with torch.no_grad():
        theirs = reference(prompt=[p for p in prompts for _ in "ab"], negative_prompt=[n for n in negatives for _ in "ab"],
                           latents=torch.from_numpy(latents), **call).images
    got = ours(prompts, negative_prompt=negatives, num_images_per_prompt=2, latents=latents, **call)
    assert_real_image(theirs)
    print(f"qwen-image two prompts, two each: |ours - diffusers| {np.abs(got - theirs).max():.1e}")
    assert np.abs(got - theirs).max() <= IMAGE_ATOL
    assert np.abs(got[0] - got[2]).max() > 0.01  # each prompt its own images
