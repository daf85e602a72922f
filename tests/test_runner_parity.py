"""The runner against diffusers' StableDiffusion3Pipeline: same weights, same latents, fp32.
Images must agree to within 1/255 (the runner's errors are measured at ~1e-5)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import assert_real_image, image_task_outputs
from runners import Pipeline

ONE_LEVEL = 1 / 255
LONG_PROMPT = "a watercolor painting of " + ", ".join(f"a tiny red castle number {i}" for i in range(30))
CASES = {
    "square": dict(prompt="a photo of a cat", height=128, width=128),
    "non_square_odd_patches": dict(prompt="a castle in the rain", height=80, width=144),  # 5 x 9 patches
    "two_per_prompt_with_negative": dict(prompt="a dragon", negative_prompt="blurry, dark", num_images_per_prompt=2,
                                         height=64, width=64),
    "no_guidance": dict(prompt="an astronaut", guidance_scale=1.0, height=96, width=96),
    "longer_than_77_clip_tokens": dict(prompt=LONG_PROMPT, height=64, width=64),
    "two_prompts_empty_negative": dict(prompt=["a cat", "a dog"], negative_prompt=["", "ugly"], height=64, width=64),
}


@pytest.fixture(scope="module", params=["ort-fp32", "ort-fp32-memory"])
def pipe(request, tiny_artifact, tiny_memory_artifact):
    """The default artifact, and the one built with the memory profile (its schedule, recomputes
    and session settings must not change an image)."""
    return Pipeline.load(tiny_memory_artifact if request.param.endswith("memory") else tiny_artifact)


def _latents(case: dict, seed: int) -> np.ndarray:
    n = (1 if isinstance(case["prompt"], str) else len(case["prompt"])) * case.get("num_images_per_prompt", 1)
    return np.random.default_rng(seed).standard_normal((n, 16, case["height"] // 8, case["width"] // 8),
                                                       dtype=np.float32)


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_images_match_diffusers(pipe, reference_pipeline, case):
    kwargs = dict(CASES[case], num_inference_steps=6, max_sequence_length=64)
    latents = _latents(kwargs, seed=len(case))
    ours = pipe(latents=latents, output_type="np", **kwargs)
    ref = reference_pipeline(latents=torch.from_numpy(latents), output_type="np", **kwargs).images
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= ONE_LEVEL
    assert_real_image(ref)  # not a constant or saturated image the test could not tell apart


def test_image_tasks_on_the_memory_artifact(tiny_artifact, tiny_memory_artifact):
    """Image to image and inpainting (held to diffusers in test_image_to_image.py) are unchanged by the
    memory profile, as text to image is."""
    refs, got = (image_task_outputs(Pipeline.load(a)) for a in (tiny_artifact, tiny_memory_artifact))
    for task, ref in refs.items():
        assert np.abs(ref - got[task]).max() <= 1e-5, task


def test_latent_output_matches_diffusers_before_the_vae(pipe, reference_pipeline):
    kwargs = dict(prompt="a photo of a cat", height=64, width=64, num_inference_steps=4, max_sequence_length=32)
    latents = _latents(kwargs, seed=3)
    ours = pipe(latents=latents, output_type="latent", **kwargs)
    ref = reference_pipeline(latents=torch.from_numpy(latents), output_type="latent", **kwargs).images.numpy()
    assert np.abs(ours - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())


def test_long_prompt_is_truncated_with_a_warning(pipe, caplog):
    pipe(LONG_PROMPT, height=64, width=64, num_inference_steps=1, seed=0, output_type="latent")
    assert any("truncated to 77 tokens" in r.getMessage() for r in caplog.records)


def test_pil_output_and_defaults_from_the_manifest(pipe):
    images = pipe("a cat", num_inference_steps=2, seed=1)
    assert len(images) == 1 and images[0].size == (128, 128) and images[0].mode == "RGB"
    again = pipe("a cat", num_inference_steps=2, seed=1)
    assert np.array_equal(np.asarray(images[0]), np.asarray(again[0]))  # seed makes runs reproducible


def test_empty_prompt_is_allowed(pipe):
    assert pipe("", height=64, width=64, num_inference_steps=1, seed=0, output_type="np").shape == (1, 64, 64, 3)
