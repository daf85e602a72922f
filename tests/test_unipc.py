"""The numpy UniPCMultistepScheduler against diffusers' over whole schedules, in Wan 2.1/2.2's configuration
and its variants: every sample of the run, the timesteps, image-to-image's start and noising, the refusals."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import UniPCMultistepScheduler

from runners.schedulers import load_scheduler

# Wan-AI/Wan2.1-T2V-1.3B-Diffusers' scheduler_config.json (the 720p models: flow_shift 5.0).
WAN = {"_class_name": "UniPCMultistepScheduler", "beta_end": 0.02, "beta_schedule": "linear", "beta_start": 0.0001,
       "disable_corrector": [], "dynamic_thresholding_ratio": 0.995, "final_sigmas_type": "zero", "flow_shift": 3.0,
       "lower_order_final": True, "num_train_timesteps": 1000, "predict_x0": True, "prediction_type": "flow_prediction",
       "rescale_betas_zero_snr": False, "sample_max_value": 1.0, "solver_order": 2, "solver_p": None,
       "solver_type": "bh2", "steps_offset": 0, "thresholding": False, "timestep_spacing": "linspace",
       "trained_betas": None, "use_beta_sigmas": False, "use_exponential_sigmas": False, "use_flow_sigmas": True,
       "use_karras_sigmas": False}
# Of the sample's scale. Measured: 6.4e-7 at worst over test_whole_schedule_matches_diffusers (float32 rounding:
# torch's float32 log and expm1 differ from numpy's in the last bit, and the errors carry through the run).
RTOL = 2e-6


def _model(sample, k):
    """A stand-in denoiser: a fixed nonlinear function of the sample and the step, so errors feed back."""
    return sample * np.float32(0.9 - 0.01 * k) - np.float32(0.3) * np.cos(sample)


def _pair(**options):
    config = {**WAN, **options}
    return UniPCMultistepScheduler.from_config(config), load_scheduler(config)


def _close(ours, ref, what):
    ref = np.asarray(ref)
    assert ours.dtype == np.float32 and ours.shape == ref.shape, what
    assert np.abs(ours - ref).max() <= RTOL * max(1.0, np.abs(ref).max()), (what, np.abs(ours - ref).max())


def _run(ref, run, start=0, steps=None, **set_timesteps):
    """Both schedulers over the schedule (from step `start`, as image-to-image runs it), the same model outputs
    fed to each; every sample compared."""
    ref.set_timesteps(steps, **set_timesteps)
    timesteps = ref.timesteps[start:]
    if start:
        ref.set_begin_index(start)
        run.begin_at(start)
    np.testing.assert_array_equal(run.timesteps, timesteps.numpy())
    assert run.timesteps.dtype == np.float32
    rng = np.random.default_rng(len(timesteps))
    x0, noise = (rng.standard_normal((1, 4, 3, 6, 8), dtype=np.float32) for _ in range(2))
    ref_sample = ref.add_noise(torch.from_numpy(x0), torch.from_numpy(noise), timesteps[:1]).numpy()
    sample = run.noised(x0, noise)
    _close(sample, ref_sample, "starting latents")
    for i, t in enumerate(timesteps):
        output = _model(sample, i)
        _close(run.predicted_original(output, i, sample), sample - ref.sigmas[start + i].numpy() * output, f"x0 {i}")
        ref_sample = ref.step(torch.from_numpy(_model(ref_sample, i)), t, torch.from_numpy(ref_sample)).prev_sample
        ref_sample = ref_sample.numpy()
        sample = run.step(output, i, sample)
        _close(sample, ref_sample, f"step {i}")


@pytest.mark.parametrize("flow_shift", [3.0, 5.0])
@pytest.mark.parametrize("steps", [1, 2, 3, 10, 50])
@pytest.mark.parametrize("order", [1, 2, 3])
@pytest.mark.parametrize("solver_type, final", [("bh2", "zero"), ("bh2", "sigma_min"), ("bh1", "sigma_min")])
def test_whole_schedule_matches_diffusers(flow_shift, steps, order, solver_type, final):
    ref, ours = _pair(flow_shift=flow_shift, solver_order=order, solver_type=solver_type, final_sigmas_type=final)
    _run(ref, ours.start(steps), steps=steps)


@pytest.mark.parametrize("options, call", [
    ({"disable_corrector": [0, 1, 5]}, {}),
    ({"lower_order_final": False, "final_sigmas_type": "sigma_min"}, {}),
    ({"timestep_spacing": "trailing"}, {}),  # the flow sigmas replace the spaced timesteps
    ({"shift_terminal": 0.1}, {}),
    ({"use_dynamic_shifting": True}, {"mu": 0.8}),
    ({"use_dynamic_shifting": True, "time_shift_type": "linear"}, {"mu": 1.5}),
    ({}, {"sigmas": np.linspace(1.0, 1 / 20, 20)}),  # a pipeline's own (FluxPipeline's rule)
])
def test_options_match_diffusers(options, call):
    ref, ours = _pair(**options)
    _run(ref, ours.start(20, call.get("mu"), call.get("sigmas")), steps=20, **call)


@pytest.mark.parametrize("steps, start", [(10, 3), (50, 35), (4, 3)])
def test_image_to_image_start_matches_diffusers(steps, start):
    """From a later step (set_begin_index): its noising, the orders' warm-up and disable_corrector's step count."""
    ref, ours = _pair(disable_corrector=[start + 1])
    _run(ref, ours.start(steps), start=start, steps=steps)


def test_the_multistep_terms_count():
    """The port's distance from diffusers is far below what the higher orders and the corrector change, so the
    comparison above would see either one missing."""
    def final(**options):
        rng = np.random.default_rng(0)
        sample = rng.standard_normal((1, 4, 3, 6, 8), dtype=np.float32)
        run = load_scheduler({**WAN, **options}).start(10)
        for i in range(10):
            sample = run.step(_model(sample, i), i, sample)
        return sample

    second = final()
    scale = np.abs(second).max()
    # Measured, of the scale: order 1 moves the result by 2.6e-2, order 3 by 4.3e-4, no corrector by 1.6e-3.
    for other in (final(solver_order=1), final(solver_order=3), final(disable_corrector=list(range(10)))):
        assert np.abs(other - second).max() > 100 * RTOL * scale


@pytest.mark.parametrize("option, match", [
    ({"thresholding": True}, "thresholding"),
    ({"use_karras_sigmas": True}, "use_karras_sigmas"),
    ({"use_exponential_sigmas": True}, "use_exponential_sigmas"),
    ({"use_beta_sigmas": True}, "use_beta_sigmas"),
    ({"prediction_type": "epsilon"}, "prediction_type"),
    ({"predict_x0": False}, "predict_x0"),
    ({"solver_p": "DDIMScheduler"}, "solver_p"),
    ({"use_flow_sigmas": False}, "use_flow_sigmas"),
    ({"solver_order": 4}, "solver_order"),
    ({"solver_type": "bh1"}, "final_sigmas_type='zero'"),  # diffusers' last step is NaN there
    ({"lower_order_final": False}, "final_sigmas_type='zero'"),  # inf here
    ({"lower_order_final": False, "final_sigmas_type": "sigma_min", "solver_order": 3}, "lower_order_final"),  # NaN
])
def test_unsupported_options_are_refused(option, match):
    with pytest.raises(ValueError, match=match):
        load_scheduler({**WAN, **option})


def test_diffusers_defaults_are_refused():
    """A config without use_flow_sigmas is diffusers' VP schedule, which the port does not implement."""
    with pytest.raises(ValueError, match="use_flow_sigmas"):
        load_scheduler({"_class_name": "UniPCMultistepScheduler"})
