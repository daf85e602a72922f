"""First-Block Cache (runners/caches/first_block.py) against diffusers' own hooks: on flux-tiny with
FluxPipeline and `transformer.enable_cache(FirstBlockCacheConfig(threshold))` (true CFG: the negative and
the positive prompt in their own cache contexts), on sd3-tiny with `apply_first_block_cache` (one batched
context). Each case asserts diffusers' decisions step by step, our counts, the image within 1/255, and that
the cache changed the image; the thresholds are chosen so that the cases skip none, some and most steps."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import assert_real_image, diffusers_fbc_decisions, with_diffusers_first_block_cache
from runners import FirstBlockCacheConfig, Pipeline
from runners.caches import parse_cache

ONE_LEVEL = 1 / 255
SD3_CALL = dict(prompt="a photo of a cat", height=64, width=64, num_inference_steps=10, max_sequence_length=32,
                guidance_scale=5.0, output_type="np")
FLUX_CALL = dict(prompt="a photo of a cat", negative_prompt="blurry, dark", true_cfg_scale=4.0, height=64, width=64,
                 num_inference_steps=10, max_sequence_length=32, output_type="np")
SD3_THRESHOLDS = (0.32, 0.38, 0.5)  # sd3-tiny at SD3_CALL: 5, 7 and 9 of 10 steps cached
FLUX_THRESHOLDS = (0.46, 0.56, 0.7)  # flux-tiny at FLUX_CALL: 6, 6; 8, 7; 9, 9 cached (uncond, cond)


@pytest.fixture(scope="module")
def sd3_pipe(tiny_artifact):
    with Pipeline.load(tiny_artifact) as pipe:
        yield pipe


def _sd3_reference(reference_pipeline, threshold: float, latents):
    """diffusers' StableDiffusion3Pipeline with `apply_first_block_cache` on its transformer (one batched context).
    Its last block returns None for the text stream (nothing reads it after the last block), which the tail hook
    subtracts: the shim returns the block's text input in its place, which changes no image."""
    last = reference_pipeline.transformer.transformer_blocks[-1]
    block_forward = last.forward

    def text_passed_on(*args, **kwargs):
        text, hidden = block_forward(*args, **kwargs)
        return (kwargs["encoder_hidden_states"] if text is None else text), hidden

    last.forward = text_passed_on
    try:
        return with_diffusers_first_block_cache(reference_pipeline, threshold, latents=torch.from_numpy(latents),
                                                **SD3_CALL)
    finally:
        del last.forward  # the class's own again


def _check(name, ours, ref, uncached, decisions, stats, ours_decisions):
    error, changed = float(np.abs(ours - ref).max()), float(np.abs(ours - uncached).max())
    print(f"{name}: diffusers {decisions}; ours {stats['full']} full, {stats['cached']} cached; "
          f"|ours - diffusers| {error:.2e}, cache changed the image by {changed:.3f}")
    assert ours_decisions == decisions
    assert error <= ONE_LEVEL
    assert changed > ONE_LEVEL  # beyond the parity bound: the cache did something
    assert_real_image(ref)


@pytest.mark.parametrize("threshold", SD3_THRESHOLDS)
def test_first_block_cache_matches_diffusers_on_sd3(sd3_pipe, reference_pipeline, threshold):
    latents = np.random.default_rng(1).standard_normal((1, 16, 8, 8), dtype=np.float32)
    uncached = sd3_pipe(latents=latents, **SD3_CALL)
    ours = sd3_pipe(latents=latents, cache=FirstBlockCacheConfig(threshold), **SD3_CALL)
    ref, seen = _sd3_reference(reference_pipeline, threshold, latents)
    _check(f"sd3-tiny threshold {threshold}", ours, ref, uncached, seen, sd3_pipe.cache_stats,
           sd3_pipe.cache_stats["decisions"]["batch"])


@pytest.fixture(scope="module")
def flux_pipes(flux_tiny_build):
    from diffusers import FluxPipeline

    reference = FluxPipeline.from_pretrained(flux_tiny_build.source.folder)
    reference.set_progress_bar_config(disable=True)
    with Pipeline.load(flux_tiny_build.folder / "ort-fp32") as pipe:
        yield pipe, reference


@pytest.mark.parametrize("threshold", FLUX_THRESHOLDS)
def test_first_block_cache_matches_diffusers_on_flux(flux_pipes, threshold):
    """FluxPipeline with `transformer.enable_cache(FirstBlockCacheConfig(threshold))`; true CFG calls the
    transformer in context "cond", then "uncond": each decides on its own residuals."""
    from diffusers.hooks import FirstBlockCacheConfig as Reference

    pipe, reference = flux_pipes
    latents = np.random.default_rng(1).standard_normal((1, 16, 64), dtype=np.float32)
    uncached = pipe(latents=latents, **FLUX_CALL)
    ours = pipe(latents=latents, cache=FirstBlockCacheConfig(threshold), **FLUX_CALL)
    reference.transformer.enable_cache(Reference(threshold=threshold))
    try:
        with diffusers_fbc_decisions() as seen:
            ref = reference(latents=torch.from_numpy(latents), **FLUX_CALL).images
    finally:
        reference.transformer.disable_cache()
    decisions = pipe.cache_stats["decisions"]
    _check(f"flux-tiny threshold {threshold}", ours, ref, uncached, {"cond": seen[0::2], "uncond": seen[1::2]},
           pipe.cache_stats, {"cond": decisions["cond"], "uncond": decisions["uncond"]})


def test_spelled_config_and_refusal_without_the_split():
    assert parse_cache("first-block:0.08") == parse_cache("first-block:threshold=0.08") == FirstBlockCacheConfig(0.08)
    before_split = {"pipeline": {"denoiser": "transformer"},
                    "submodules": {"transformer": {"outputs": [{"name": "noise_pred"}]}}}
    unet = {"pipeline": {"denoiser": "unet"}, "submodules": {"unet": {"outputs": [{"name": "noise_pred"}]}}}
    for manifest in (before_split, unet):
        with pytest.raises(ValueError, match="needs the transformer split after its first block") as refused:
            FirstBlockCacheConfig(0.08).check(manifest)
        assert "\n" not in str(refused.value) and "use taylorseer" in str(refused.value)


def test_the_first_block_graph_opens_at_the_first_call_that_caches(tiny_artifact):
    """Loading does not open transformer_first_block (a call without the cache never runs it); the first cached
    call opens it, and a pipeline loaded without it refuses the cache in one line."""
    from runners.caches import cache_graphs

    with Pipeline.load(tiny_artifact) as pipe:
        assert cache_graphs(pipe.manifest) == {"transformer_first_block"}
        pipe(**{**SD3_CALL, "num_inference_steps": 2})
        assert "transformer_first_block" not in pipe.sessions
        pipe(**{**SD3_CALL, "num_inference_steps": 2}, cache="first-block:0.32")
        assert "transformer_first_block" in pipe.sessions and pipe.cache_stats["full"] >= 1
        without = [n for n in pipe.manifest["submodules"] if n != "transformer_first_block"]
    with Pipeline.load(tiny_artifact, submodules=without) as pipe:
        with pytest.raises(ValueError, match="runs transformer_first_block, which this pipeline did not open"):
            pipe(**{**SD3_CALL, "num_inference_steps": 2}, cache="first-block:0.32")
