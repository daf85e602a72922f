"""Tiled VAE against diffusers' own tiled VAE on the same weights, and past the engine's range."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from runners import Pipeline

SAME_ALGORITHM = 1e-4  # ours vs diffusers' tiled result: the same arithmetic in another runtime


@pytest.fixture(scope="module")
def pipe(tiny_artifact):
    return Pipeline.load(tiny_artifact)


@pytest.fixture(scope="module")
def vae(reference_pipeline):
    return reference_pipeline.vae


def _diffusers_tiled_decode(vae, z, tile_latent):
    vae.tile_latent_min_size, vae.tile_sample_min_size = tile_latent, tile_latent * 8
    with torch.no_grad():
        return vae.tiled_decode(torch.from_numpy(z), return_dict=False)[0].numpy()


def _latents(side, seed=0):
    return np.random.default_rng(seed).standard_normal((1, 16, side, side), dtype=np.float32)


def test_tiled_decode_errs_no_more_than_diffusers_tiling(pipe, vae):
    """At a size the engine decodes whole, forcing 32-latent tiles: ours tiled vs ours whole is no
    further apart than diffusers tiled vs diffusers whole, and ours tiled matches theirs."""
    z = _latents(64)
    ours_whole = pipe.vae_decode(z, tiling=False)
    ours_tiled = pipe.vae_decode(z, tiling=True, tile_size=32)
    theirs_tiled = _diffusers_tiled_decode(vae, z, 32)
    with torch.no_grad():
        theirs_whole = vae.decode(torch.from_numpy(z), return_dict=False)[0].numpy()
    ours_err, theirs_err = np.abs(ours_tiled - ours_whole).max(), np.abs(theirs_tiled - theirs_whole).max()
    assert theirs_err > 1e-3  # tiling changes the image: the comparison means something
    assert ours_err <= theirs_err + SAME_ALGORITHM
    assert np.abs(ours_tiled - theirs_tiled).max() <= SAME_ALGORITHM


def test_decode_past_the_engine_range_tiles_automatically(pipe, vae):
    hi = pipe.manifest["submodules"]["vae_decoder"]["dims"]["latent_height"][2]
    z = _latents(2 * hi, seed=1)  # twice the largest side the engine was built for
    image = pipe.vae_decode(z)
    assert image.shape == (1, 3, 16 * hi, 16 * hi)
    assert np.abs(image - _diffusers_tiled_decode(vae, z, hi)).max() <= SAME_ALGORITHM
    with pytest.raises(ValueError, match=f"input of {2 * hi}x{2 * hi} exceeds the engine's maximum {hi}x{hi}"):
        pipe.vae_decode(z, tiling=False)


def test_an_edge_tile_below_the_engine_minimum_is_padded(pipe, vae):
    lo, _, hi = pipe.manifest["submodules"]["vae_decoder"]["dims"]["latent_height"]
    side = 2 * int(hi * 0.75) + lo // 2  # the last tile is half the engine's minimum
    z = _latents(side, seed=2)
    image = pipe.vae_decode(z)
    assert image.shape == (1, 3, 8 * side, 8 * side) and np.isfinite(image).all()
    inner = 8 * int(hi * 0.75) * 2 - 8 * hi // 4  # before the padded tile's blend starts
    theirs = _diffusers_tiled_decode(vae, z, hi)
    assert np.abs(image[..., :inner, :inner] - theirs[..., :inner, :inner]).max() <= SAME_ALGORITHM


def test_tiled_encode_matches_diffusers(pipe, vae):
    hi = pipe.manifest["submodules"]["vae_encoder"]["dims"]["image_height"][2]
    image = np.random.default_rng(3).uniform(-1, 1, (1, 3, 2 * hi, 2 * hi)).astype(np.float32)
    mean, logvar = pipe.vae_encode(image)
    vae.tile_sample_min_size, vae.tile_latent_min_size = hi, hi // 8
    with torch.no_grad():
        moments = vae._tiled_encode(torch.from_numpy(image)).numpy()
    assert mean.shape == (1, 16, hi // 4, hi // 4)
    assert np.abs(mean - moments[:, :16]).max() <= SAME_ALGORITHM
    assert np.abs(logvar - np.clip(moments[:, 16:], -30, 20)).max() <= SAME_ALGORITHM


def test_bad_tile_size_is_refused(pipe):
    with pytest.raises(ValueError, match=r"tile_size=4 is outside the engine's range"):
        pipe.vae_decode(_latents(16), tiling=True, tile_size=4)
