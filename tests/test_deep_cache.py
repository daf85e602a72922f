"""DeepCache (runners/caches/deep_cache.py) on the U-Net families against the DeepCache library's own
`DeepCacheSDHelper` on diffusers' pipelines: same weights and latents, images within 1/255, the library's
full steps counted, and each case asserts that the cache changed the image (it fails if nothing was cached)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import assert_real_image, library_deep_cache, ours_and_diffusers
from runners import DeepCacheConfig, Pipeline

ONE_LEVEL = 1 / 255
# The cache's effect on the image must be 5 levels or more (measured: sd15 0.116 and 0.103, sdxl 0.039).
CASES = {  # family, interval, the call: SD1.5's PNDM repeats a timestep (one more evaluation than steps)
    "sd15 interval 2": ("sd15", 2, dict(prompt="a photo of a cat", height=64, width=64, num_inference_steps=8)),
    "sd15 interval 3, two per prompt": ("sd15", 3, dict(prompt="a castle", negative_prompt="blurry", height=64,
                                                        width=128, num_inference_steps=10, num_images_per_prompt=2)),
    "sdxl interval 3": ("sdxl", 3, dict(prompt="a red fox", height=64, width=64, num_inference_steps=9)),
}


@pytest.fixture(scope="module")
def sd15(sd15_tiny_build):
    return ours_and_diffusers(sd15_tiny_build, "StableDiffusionPipeline")


@pytest.fixture(scope="module")
def sdxl(sdxl_tiny_build):
    return ours_and_diffusers(sdxl_tiny_build, "StableDiffusionXLPipeline")


@pytest.mark.parametrize("case", CASES)
def test_matches_the_deepcache_library(request, case):
    family, interval, call = CASES[case]
    pipe, reference = request.getfixturevalue(family)
    n = call.get("num_images_per_prompt", 1)
    latents = np.random.default_rng(len(case)).standard_normal((n, 4, call["height"] // 8, call["width"] // 8),
                                                                dtype=np.float32)
    with library_deep_cache(reference, interval) as library_full:
        ref = reference(latents=torch.from_numpy(latents), output_type="np", **call).images
    ours = pipe(latents=latents, output_type="np", cache=DeepCacheConfig(cache_interval=interval), **call)
    stats = pipe.cache_stats
    uncached = pipe(latents=latents, output_type="np", **call)
    err, change = float(np.abs(ours - ref).max()), float(np.abs(ours - uncached).max())
    print(f"{case}: {stats['full']} full, {stats['cached']} cached; max abs error {err:.1e}, the cache's effect "
          f"{change:.3f}")
    assert (stats["full"], stats["cached"]) == (len(library_full), reference.scheduler.timesteps.numel()
                                                - len(library_full)) and stats["cached"] > 0
    assert err <= ONE_LEVEL, err
    assert change > 5 * ONE_LEVEL, "the cache changed nothing: the test would prove nothing"
    assert_real_image(ref)


def test_a_transformer_artifact_refuses_it(tiny_artifact):
    with Pipeline.load(tiny_artifact) as pipe, pytest.raises(ValueError, match="DeepCache needs the U-Net's shallow "
                                                                               r"branch \(unet_shallow\)"):
        pipe("a cat", cache="deepcache:2", height=64, width=64, num_inference_steps=2)


def test_the_shallow_graph_is_a_small_part_of_the_unet(sd15):
    """What a cached step saves: the shallow branch carries a few percent of the U-Net's weights."""
    pipe, _ = sd15
    sizes = {name: sum(f.stat().st_size for f in pipe.folder.glob(f"{name}.*")) for name in ("unet", "unet_shallow")}
    assert sizes["unet_shallow"] < 0.1 * sizes["unet"], sizes
