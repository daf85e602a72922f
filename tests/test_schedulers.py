"""The numpy scheduler ports against diffusers: timesteps, initial noise scale, input scaling and
every update, for several step counts and configs (the real SD1.5 and SDXL ones among them)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler, PNDMScheduler

from export.registry import SD15_SCHEDULER, SDXL_SCHEDULER
from runners.schedulers import load_scheduler

CONFIGS = {
    "flow_sd3": (FlowMatchEulerDiscreteScheduler, {"num_train_timesteps": 1000, "shift": 3.0}),
    "flow_dynamic_shifting": (FlowMatchEulerDiscreteScheduler, {"shift": 3.0, "use_dynamic_shifting": True}),
    "flow_linear_time_shift": (FlowMatchEulerDiscreteScheduler, {"use_dynamic_shifting": True,
                                                                 "time_shift_type": "linear"}),
    "flow_shift_terminal": (FlowMatchEulerDiscreteScheduler, {"shift": 3.0, "shift_terminal": 0.02}),
    "pndm_sd15": (PNDMScheduler, SD15_SCHEDULER),
    "pndm_trailing_v": (PNDMScheduler, {**SD15_SCHEDULER, "timestep_spacing": "trailing",
                                        "prediction_type": "v_prediction"}),
    "pndm_linspace_linear_betas": (PNDMScheduler, {**SD15_SCHEDULER, "timestep_spacing": "linspace",
                                                   "beta_schedule": "linear", "set_alpha_to_one": True}),
    "ddim_sd15": (DDIMScheduler, SD15_SCHEDULER),
    "ddim_trailing_v": (DDIMScheduler, {**SD15_SCHEDULER, "timestep_spacing": "trailing",
                                        "prediction_type": "v_prediction"}),
    "ddim_linspace": (DDIMScheduler, {**SD15_SCHEDULER, "timestep_spacing": "linspace"}),
    "euler_sdxl": (EulerDiscreteScheduler, SDXL_SCHEDULER),
    "euler_trailing_v": (EulerDiscreteScheduler, {**SDXL_SCHEDULER, "timestep_spacing": "trailing",
                                                  "prediction_type": "v_prediction"}),
    "euler_linspace": (EulerDiscreteScheduler, {**SDXL_SCHEDULER, "timestep_spacing": "linspace"}),
}
RTOL = 1e-5  # of the sample's scale: float32 rounding only


def _pair(name):
    cls, config = CONFIGS[name]
    ref = cls.from_config({k: v for k, v in config.items() if k != "_class_name"})
    return ref, load_scheduler(dict(ref.config, _class_name=cls.__name__))


def _close(ours, ref, what):
    ref = np.asarray(ref)
    assert ours.shape == ref.shape, what
    assert np.abs(ours - ref).max() <= RTOL * max(1.0, np.abs(ref).max()), (what, np.abs(ours - ref).max())


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("steps", [1, 2, 4, 20, 28, 50])
def test_schedule_and_updates_match_diffusers(name, steps):
    if steps == 1 and "shift_terminal" in CONFIGS[name][1]:
        pytest.skip("one step cannot be stretched to a terminal shift: diffusers divides 0 by 0 there too")
    ref, ours = _pair(name)
    mu = ours.mu_for(128, 96, patch_size=2) if hasattr(ours, "mu_for") else None
    ref.set_timesteps(steps, **({"mu": mu} if mu is not None else {}))
    run = ours.start(steps, mu)
    _close(run.timesteps, ref.timesteps.numpy().astype(np.float32), "timesteps")
    assert run.timesteps.dtype == np.float32
    reference_sigma = float(getattr(ref, "init_noise_sigma", 1.0))  # flow matching has none: 1
    assert abs(run.init_noise_sigma - reference_sigma) <= RTOL * reference_sigma, name

    rng = np.random.default_rng(steps)
    sample = rng.standard_normal((2, 4, 8, 8), dtype=np.float32) * np.float32(run.init_noise_sigma)
    for i, t in enumerate(ref.timesteps):
        if hasattr(ref, "scale_model_input"):
            _close(run.scale_model_input(sample, i), ref.scale_model_input(torch.from_numpy(sample), t).numpy(),
                   f"scaled input {i}")
        output = rng.standard_normal(sample.shape, dtype=np.float32)
        expected = ref.step(torch.from_numpy(output), t, torch.from_numpy(sample)).prev_sample.numpy()
        _close(run.step(output, i, sample), expected, f"step {i}")
        sample = expected  # each update is compared from the same sample


@pytest.mark.parametrize("cls, option", [
    ("FlowMatchEulerDiscreteScheduler", {"use_karras_sigmas": True}),
    ("EulerDiscreteScheduler", {"use_karras_sigmas": True}),
    ("DDIMScheduler", {"thresholding": True}),
    ("PNDMScheduler", {"skip_prk_steps": False}),
    ("EulerDiscreteScheduler", {"beta_schedule": "squaredcos_cap_v2"}),
])
def test_unsupported_options_are_refused(cls, option):
    with pytest.raises(ValueError, match=next(iter(option))):
        load_scheduler({"_class_name": cls, **option})


def test_unknown_scheduler_is_refused():
    with pytest.raises(ValueError, match="'LMSDiscreteScheduler' is not supported"):
        load_scheduler({"_class_name": "LMSDiscreteScheduler"})
