"""Guidance rules against the reference arithmetic of the diffusers pipelines that define them, on random
predictions (the families' parity tests run them in whole pipelines)."""
from __future__ import annotations

import numpy as np
import torch

from runners.guidance import QWEN_TRUE_CFG, TRUE_CFG, EmbeddedGuidance
from runners.options import Option


def test_qwen_true_cfg_rescales_each_packed_token_as_diffusers():
    """QwenImagePipeline: the guided prediction of the packed latents (its _pack_latents), each token rescaled
    to the norm of the prompt's prediction; a plain true CFG differs, so the rescale is what is measured."""
    from diffusers import QwenImagePipeline

    rng = np.random.default_rng(0)
    noise = rng.standard_normal((4, 16, 6, 10), dtype=np.float32)  # the uncond half, then the cond half
    scale = 4.0
    ours = QWEN_TRUE_CFG.combine(noise, scale)
    uncond, cond = (QwenImagePipeline._pack_latents(torch.from_numpy(x), 2, 16, 6, 10) for x in np.split(noise, 2))
    comb = uncond + scale * (cond - uncond)
    expected = comb * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
    got = QwenImagePipeline._pack_latents(torch.from_numpy(ours), 2, 16, 6, 10)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=2e-6, atol=1e-6)
    assert np.abs(ours - TRUE_CFG.combine(noise, scale)).max() > 0.1
    assert (QWEN_TRUE_CFG.on(1.0), QWEN_TRUE_CFG.on(4.0), QWEN_TRUE_CFG.options[0].default) == (False, True, 4.0)


def test_embedded_guidance_is_one_feed_per_row():
    rule = EmbeddedGuidance(Option("guidance_scale", "float", "the embedded scale"))
    feeds = rule.conditions(3.5, 4)
    assert list(feeds) == ["guidance"] and feeds["guidance"].dtype == np.float32
    np.testing.assert_array_equal(feeds["guidance"], np.full(4, 3.5, np.float32))
