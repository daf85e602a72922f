"""Latent layouts (runners/latents/) against diffusers' own packing, position ids and normalisation; no export."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import runners.families  # noqa: F401  (registers the families whose layouts are read)
from runners.latents import PER_CHANNEL, LatentLayout, positions
from runners.pipeline import FAMILIES


def _latents(*shape: int) -> np.ndarray:
    return np.random.default_rng(sum(shape)).standard_normal(shape, dtype=np.float32)


def test_packing_is_diffusers_packing_and_unpacking_inverts_it():
    from diffusers import Flux2KleinPipeline, FluxPipeline, LTXPipeline, QwenImagePipeline

    x = _latents(2, 16, 6, 10)
    patched = LatentLayout(patch=2)
    for theirs in (FluxPipeline._pack_latents(torch.from_numpy(x), 2, 16, 6, 10),
                   QwenImagePipeline._pack_latents(torch.from_numpy(x), 2, 16, 6, 10)):
        assert np.array_equal(patched.pack(x), theirs.numpy())
    assert np.array_equal(patched.unpack(patched.pack(x), (6, 10)), x)
    # tokens past the latents' (references after them) are dropped
    assert np.array_equal(patched.unpack(np.concatenate([patched.pack(x)] * 2, axis=1), (6, 10)), x)
    assert np.array_equal(LatentLayout().pack(x), Flux2KleinPipeline._pack_latents(torch.from_numpy(x)).numpy())
    clip = _latents(2, 8, 3, 4, 6)
    video = LatentLayout(video=True)
    assert np.array_equal(video.pack(clip), LTXPipeline._pack_latents(torch.from_numpy(clip)).numpy())
    assert np.array_equal(video.unpack(video.pack(clip), (3, 4, 6)), clip)


def test_position_ids_are_diffusers():
    from diffusers import Flux2KleinPipeline, FluxPipeline
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

    flux1 = FluxPipeline._prepare_latent_image_ids(1, 3, 5, torch.device("cpu"), torch.float32).numpy()
    assert np.array_equal(positions.flux1(3, 5), flux1)
    flux2 = Flux2KleinPipeline._prepare_latent_ids(torch.zeros(1, 128, 3, 5))[0].numpy()
    assert np.array_equal(positions.flux2(3, 5), flux2)
    # Qwen-Image's centred rows and columns, and its text after them: the rows of QwenEmbedRope's tables they index
    rope = QwenEmbedRope(theta=10000, axes_dim=[4, 4, 4], scale_rope=True)
    image, text = rope([(1, 3, 5)], device=torch.device("cpu"), max_txt_seq_len=7)

    def row(p: int, axis: int) -> torch.Tensor:
        table = rope.pos_freqs if p >= 0 else rope.neg_freqs
        return table[p if p >= 0 else 4096 + p, 2 * axis:2 * axis + 2]

    ours = torch.stack([torch.cat([row(p, a) for a, p in enumerate(ids)]) for ids in positions.qwen(3, 5).astype(int)])
    assert torch.equal(ours, image)
    assert torch.equal(rope.pos_freqs[positions.qwen_text(7, [(3, 5)])[:, 0].astype(int)], text)


def test_per_channel_normalisation_is_ltx_pipelines():
    from diffusers import LTXPipeline

    class Pipe:  # what the normalisation reads of a pipeline
        constants = {"latents_mean": [0.5, -1.0, 2.0], "latents_std": [2.0, 0.5, 4.0], "vae_scaling_factor": 1.5}

    z = _latents(1, 3, 2, 4, 4)
    mean, std = (torch.tensor(Pipe.constants[k]) for k in ("latents_mean", "latents_std"))
    theirs = LTXPipeline._normalize_latents(torch.from_numpy(z), mean, std, 1.5).numpy()
    np.testing.assert_allclose(PER_CHANNEL.from_vae(Pipe, z), theirs, rtol=1e-6, atol=1e-6)
    back = LTXPipeline._denormalize_latents(torch.from_numpy(theirs), mean, std, 1.5).numpy()
    np.testing.assert_allclose(PER_CHANNEL.to_vae(Pipe, theirs), back, rtol=1e-6, atol=1e-6)


def test_shapes_and_tokens():
    class Pipe:
        constants = {"vae_scale_factor": 8, "vae_temporal_scale": 4}
        manifest = {"constants": {"latent_channels": 16}}

    assert LatentLayout().shape(Pipe, 2, 64, 96) == (2, 16, 8, 12)
    wan = LatentLayout(patch=2, video=True)
    assert wan.shape(Pipe, 1, 64, 96, frames=9) == (1, 16, 3, 8, 12)
    assert wan.tokens((3, 8, 12)) == 3 * 4 * 6  # WanTransformer3DModel's sequence: 1 x 2 x 2 patches
    assert LatentLayout(patch=2).tokens((8, 12)) == 24


def test_packed_latents_of_another_shape_are_refused_naming_the_shape():
    layout = LatentLayout(patch=2, packed_latents=True)
    with pytest.raises(ValueError, match=r"latents have shape \(1, 16, 8, 8\); this request takes packed latents "
                                         r"\(N, 16, 64\), as diffusers' FluxPipeline does"):
        layout.from_diffusers(np.zeros((1, 16, 8, 8)), (1, 16, 8, 8), "FluxPipeline")
    assert LatentLayout().from_diffusers(np.ones((1, 4, 8, 8)), (1, 4, 8, 8), "p").dtype == np.float32


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_declares_its_layout(family):
    """Video families' latents are 5-D; the families whose diffusers pipelines take packed latents say so."""
    layout = FAMILIES[family].layout
    assert layout.video == (family in ("wan", "ltx"))
    assert layout.packed_latents == (family in ("flux", "qwen_image", "qwen_image_edit", "qwen_image21", "ltx"))
    assert (layout.positions is None) == (family not in ("flux", "flux2", "qwen_image", "qwen_image_edit",
                                                         "qwen_image21"))


def test_a_static_request_is_refused_for_a_video_model():
    """--static fixes an image request: a video model's engines would take the frame count's opt value, whatever
    the request, so the build is refused in one line."""
    from runners.static import StaticRequest

    with pytest.raises(ValueError, match="a video model's engines also take its frame count"):
        StaticRequest(64, 64).resolved({"default_image_size": 64}, {"latent_frames": [1, 3, 5], "batch": [1, 2, 4]})
