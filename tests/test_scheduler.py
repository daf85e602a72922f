"""The numpy FlowMatchEulerDiscrete port against diffusers, for several step counts and configs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from runners.scheduler import load_scheduler

CONFIGS = {
    "sd3": {"num_train_timesteps": 1000, "shift": 3.0},
    "dynamic_shifting": {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True},
    "linear_time_shift": {"use_dynamic_shifting": True, "time_shift_type": "linear"},
    "shift_terminal": {"shift": 3.0, "shift_terminal": 0.02},
}


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("steps", [2, 4, 20, 28, 50])
def test_timesteps_and_sigmas_match_diffusers(name, steps):
    ref = FlowMatchEulerDiscreteScheduler(**CONFIGS[name])
    ours = load_scheduler(dict(ref.config, _class_name="FlowMatchEulerDiscreteScheduler"))
    mu = ours.mu_for(128, 96, patch_size=2)
    ref.set_timesteps(steps, mu=mu)
    timesteps, sigmas = ours.timesteps(steps, mu)
    assert np.abs(timesteps - ref.timesteps.numpy()).max() <= 1e-6 * 1000  # timesteps are sigma x 1000
    assert np.abs(sigmas - ref.sigmas.numpy()).max() <= 1e-6


def test_step_matches_diffusers():
    ref = FlowMatchEulerDiscreteScheduler(shift=3.0)
    ours = load_scheduler(dict(ref.config, _class_name="FlowMatchEulerDiscreteScheduler"))
    ref.set_timesteps(5)
    _, sigmas = ours.timesteps(5)
    rng = np.random.default_rng(0)
    sample = rng.standard_normal((2, 4, 8, 8), dtype=np.float32)
    for i, t in enumerate(ref.timesteps):
        velocity = rng.standard_normal(sample.shape, dtype=np.float32)
        expected = ref.step(torch.from_numpy(velocity), t, torch.from_numpy(sample)).prev_sample.numpy()
        sample = ours.step(velocity, sigmas[i], sigmas[i + 1], sample)
        assert np.abs(sample - expected).max() <= 1e-6


def test_unsupported_options_are_refused():
    with pytest.raises(ValueError, match="use_karras_sigmas"):
        load_scheduler({"_class_name": "FlowMatchEulerDiscreteScheduler", "use_karras_sigmas": True})
    with pytest.raises(ValueError, match="'DDIMScheduler' is not supported"):
        load_scheduler({"_class_name": "DDIMScheduler"})
