"""Step caches (runners/caches): TaylorSeer lite against diffusers' own hook, counted evaluations
for its schedules, enable/disable and per-call caches, the CLI's and serving's spelling, and live
previews. Each parity case asserts that the cache changed the image, so it fails if nothing was cached."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import assert_real_image, diffusers_schedule, with_diffusers_taylorseer
from runners import Pipeline, TaylorSeerCacheConfig
from runners.caches import parse_cache

ONE_LEVEL = 1 / 255
SD3_CALL = dict(prompt="a photo of a cat", height=64, width=64, num_inference_steps=10, max_sequence_length=32,
                output_type="np")
SD3_CASES = {  # name: our config (diffusers' equal below)
    "interval 2, order 1": TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=2, max_order=1),
    "interval 3, order 2, last two full": TaylorSeerCacheConfig(cache_interval=3, disable_cache_before_step=3,
                                                                  disable_cache_after_step=8, max_order=2),
}


@pytest.fixture(scope="module")
def sd3_pipe(tiny_artifact):
    with Pipeline.load(tiny_artifact) as pipe:
        yield pipe


def _latents(seed=0, shape=(1, 16, 8, 8)):
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


@pytest.mark.parametrize("case", SD3_CASES)
def test_taylorseer_matches_diffusers_hook_on_sd3(sd3_pipe, reference_pipeline, case):
    config = SD3_CASES[case]
    latents = _latents(seed=len(case))
    uncached = sd3_pipe(latents=latents, **SD3_CALL)
    ours = sd3_pipe(latents=latents, cache=config, **SD3_CALL)
    ref, calls = with_diffusers_taylorseer(reference_pipeline, config, "proj_out", latents=torch.from_numpy(latents),
                                           **SD3_CALL)
    schedule = diffusers_schedule(config, SD3_CALL["num_inference_steps"])
    assert calls == len(schedule)
    assert (sd3_pipe.cache_stats["full"], sd3_pipe.cache_stats["cached"]) == (sum(schedule), schedule.count(False))
    error = float(np.abs(ours - ref).max())
    changed = float(np.abs(ours - uncached).max())
    print(f"{case}: {sum(schedule)} full, {schedule.count(False)} cached; |ours - diffusers| {error:.2e}, "
          f"cache changed the image by {changed:.3f}")
    assert error <= ONE_LEVEL
    assert changed > 3 * ONE_LEVEL  # the cache did something (beyond the parity bound), as diffusers' hook did
    assert_real_image(ref)


def test_disable_cache_gives_the_uncached_image_and_state_resets_per_call(sd3_pipe):
    latents = _latents(seed=5)
    uncached = sd3_pipe(latents=latents, **SD3_CALL)
    assert sd3_pipe.cache_stats["cached"] == 0 and sd3_pipe.cache_stats["full"] == 10
    sd3_pipe.enable_cache("taylorseer:interval=2,before=2")
    try:
        first = sd3_pipe(latents=latents, **SD3_CALL)
        again = sd3_pipe(latents=latents, **SD3_CALL)  # a fresh cache: the same image, not the last call's factors
        assert sd3_pipe.cache_stats["cached"] == 4
        assert np.array_equal(first, again) and not np.array_equal(first, uncached)
        assert sd3_pipe(latents=latents, cache=None, **SD3_CALL).tobytes() == uncached.tobytes()  # off for one call
    finally:
        sd3_pipe.disable_cache()
    assert sd3_pipe(latents=latents, **SD3_CALL).tobytes() == uncached.tobytes()


def test_openvino_genai_schedule_counts(sd3_pipe):
    """openvino.genai's default (interval 3, from step 6, the last two in full) at 28 steps: 15 full, 13 cached."""
    config = parse_cache("taylorseer:interval=3,before=6,after=-2,order=1")
    schedule = diffusers_schedule(config, 28)
    assert (sum(schedule), schedule.count(False)) == (15, 13)
    sd3_pipe(**{**SD3_CALL, "num_inference_steps": 28}, latents=_latents(), cache=config)
    stats = sd3_pipe.cache_stats
    assert (stats["full"], stats["cached"]) == (15, 13)
    print(f"sd3-tiny 64x64, 28 steps: {stats['full_seconds'] / 15 * 1e3:.2f} ms a full evaluation, "
          f"{stats['cached_seconds'] / 13 * 1e3:.3f} ms a cached one")


def test_unet_family_counts_and_changes(sd15_tiny_build):
    """SD1.5's PLMS runs one more evaluation than steps: the cache counts evaluations, as diffusers' hook does."""
    config = TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=2, max_order=1)
    with Pipeline.load(sd15_tiny_build.folder / "ort-fp32") as pipe:
        call = dict(prompt="a cat", height=64, width=64, num_inference_steps=8, output_type="np",
                    latents=_latents(shape=(1, 4, 8, 8)))
        uncached = pipe(**call)
        cached = pipe(**call, cache=config)
        schedule = diffusers_schedule(config, 9)
        assert (pipe.cache_stats["full"], pipe.cache_stats["cached"]) == (sum(schedule), schedule.count(False))
        assert np.abs(cached - uncached).max() > ONE_LEVEL


def test_taylorseer_factors_match_diffusers_state():
    """Our finite differences and extrapolation against diffusers' TaylorSeerState on arrays (no model)."""
    from diffusers.hooks.taylorseer_cache import TaylorSeerState

    from runners.caches.taylorseer import _Factors

    rng = np.random.default_rng(0)
    ref, ours = TaylorSeerState(taylor_factors_dtype=torch.float32, max_order=2), _Factors()
    for step in (0, 1, 2, 5, 8):
        output = rng.standard_normal((2, 3, 4), dtype=np.float32)
        ref.current_step = step
        ref.update((torch.from_numpy(output),))
        ours.update(output, step, max_order=2)
    for step in (9, 10):
        ref.current_step = step
        np.testing.assert_allclose(ours.predict(step), ref.predict()[0].numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("text, named", [
    ("taylorseer:interval=0", "cache_interval=0"),
    ("taylorseer:before=-1", "disable_cache_before_step=-1"),
    ("taylorseer:order=1.5", "max_order=1.5"),
    ("taylorseer:lite=false", "only use_lite_mode=True"),
    ("taylorseer:speed=2", "unknown option 'speed'"),
    ("taylorseer:after=soon", "after='soon' is not a number"),
    ("magcache", "cache 'magcache' is not known"),
    ("first-block:-0.1", "threshold=-0.1 is not allowed"),
    ("first-block:0.1,speed=2", "unknown option 'speed'"),
    ("deepcache:0", "cache_interval=0 is not allowed"),
    ("deepcache:branch=1", "cache_branch_id=1 is not allowed"),
])
def test_bad_cache_values_are_refused_in_one_line(text, named, tmp_path, capsys):
    from runners.__main__ import main

    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(".", r"\.")):
        parse_cache(text)
    code = main([str(tmp_path / "no-artifact"), "--prompt", "a cat", "--cache", text, "--out", str(tmp_path / "o.png")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and named in err


def test_serving_request_turns_a_cache_on(sd3_pipe):
    from runners.serving.requests import calls, run

    tensors = {"prompt": np.array([[b"a cat"]], dtype=object), "cache": np.array([[b"taylorseer:interval=2,before=2"]],
                                                                                 dtype=object),
               "height": np.array([[64]], np.int32), "width": np.array([[64]], np.int32),
               "num_inference_steps": np.array([[6]], np.int32), "seed": np.array([[3]], np.int64)}
    (call,) = calls(tensors)
    assert call["cache"] == "taylorseer:interval=2,before=2"
    served = run(sd3_pipe, [call])[0][0]
    assert sd3_pipe.cache_stats["cached"] == 2
    alone = np.asarray(sd3_pipe("a cat", seed=3, height=64, width=64, num_inference_steps=6,
                                cache=TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=2))[0])
    assert np.array_equal(served, alone)
    with pytest.raises(ValueError, match="cache_interval=0"):
        run(sd3_pipe, calls({**tensors, "cache": np.array([[b"taylorseer:interval=0"]], dtype=object)}))


def test_previews_projection_count_size_and_final_image(sd3_pipe):
    """Without a tiny decoder the previews are the latent-to-RGB projection; they do not change the image."""
    call = dict(SD3_CALL, num_inference_steps=7, height=64, width=96, latents=_latents(shape=(1, 16, 8, 12)))
    plain = sd3_pipe(**call)
    seen = []
    previewed = sd3_pipe(**call, preview_every=3, on_preview=lambda step, images: seen.append((step, images)))
    assert [step for step, _ in seen] == [3, 6]
    assert all(len(images) == 1 and images[0].size == (96, 64) for _, images in seen)
    assert np.array_equal(plain, previewed)
    assert sd3_pipe.timings["previews"] > 0
    with pytest.raises(ValueError, match="preview_every=0"):
        sd3_pipe(**call, preview_every=0, on_preview=print)


FLUX_CASES = {  # name: (our config, request); true CFG runs diffusers' "cond" and "uncond" contexts apart
    "interval 2, order 1": (TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=2, max_order=1), {}),
    "interval 3, order 2, true CFG": (
        TaylorSeerCacheConfig(cache_interval=3, disable_cache_before_step=2, disable_cache_after_step=7, max_order=2),
        dict(negative_prompt="blurry", true_cfg_scale=4.0)),
}


@pytest.mark.parametrize("case", FLUX_CASES)
def test_taylorseer_matches_diffusers_lite_mode_on_flux(flux_tiny_build, case):
    """diffusers' own lite mode, as FluxPipeline runs it: `pipe.transformer.enable_cache(config)`."""
    from diffusers import FluxPipeline
    from diffusers.hooks import TaylorSeerCacheConfig as Reference

    config, extra = FLUX_CASES[case]
    call = dict(prompt="a photo of a cat", height=64, width=64, num_inference_steps=9, max_sequence_length=16,
                output_type="np", **extra)
    latents = np.random.default_rng(len(case)).standard_normal((1, 16, 64), dtype=np.float32)
    reference = FluxPipeline.from_pretrained(flux_tiny_build.source.folder)
    reference.set_progress_bar_config(disable=True)
    reference.transformer.enable_cache(Reference(
        cache_interval=config.cache_interval, disable_cache_before_step=config.disable_cache_before_step,
        disable_cache_after_step=config.disable_cache_after_step, max_order=config.max_order,
        taylor_factors_dtype=torch.float32, use_lite_mode=True))
    ref = reference(latents=torch.from_numpy(latents), **call).images
    with Pipeline.load(flux_tiny_build.folder / "ort-fp32") as pipe:
        uncached = pipe(latents=latents, **call)
        ours = pipe(latents=latents, cache=config, **call)
        stats = pipe.cache_stats
    schedule = diffusers_schedule(config, 9)
    assert (stats["full"], stats["cached"]) == (sum(schedule), schedule.count(False))
    error, changed = float(np.abs(ours - ref).max()), float(np.abs(ours - uncached).max())
    print(f"flux-tiny {case}: {sum(schedule)} full, {schedule.count(False)} cached; |ours - diffusers| {error:.2e}, "
          f"cache changed the image by {changed:.3f}")
    assert error <= ONE_LEVEL
    assert changed > 3 * ONE_LEVEL
    assert_real_image(ref)
