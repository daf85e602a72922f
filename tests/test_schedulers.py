"""The numpy scheduler ports against diffusers: timesteps, initial noise scale, input scaling and
every update, for several step counts and configs (the real SD1.5 and SDXL ones among them)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler, PNDMScheduler

from export.registry import SD15_SCHEDULER, SDXL_SCHEDULER
from runners.schedulers import load_scheduler
from runners.schedulers.schedule import strength_start

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
    ref, ours = _pair(name)
    if steps == 1 and "shift_terminal" in CONFIGS[name][1]:  # diffusers divides 0 by 0 there: NaN timesteps
        with pytest.raises(ValueError, match="num_inference_steps=1 cannot be stretched"):
            ours.start(steps)
        return
    mu = ours.mu_for(64 * 48) if hasattr(ours, "mu_for") else None
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


def _ref_noised(ref, x0, noise, timestep):
    """diffusers' own rule: flow matching's scale_noise, the others' add_noise."""
    t = torch.as_tensor([timestep])
    x0, noise = torch.from_numpy(x0), torch.from_numpy(noise)
    return (ref.scale_noise(x0, t, noise) if hasattr(ref, "scale_noise") else ref.add_noise(x0, noise, t)).numpy()


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("steps", [1, 2, 3, 4, 7, 20, 28, 50])
@pytest.mark.parametrize("strength", [0.05, 0.3, 0.6, 1.0])
def test_image_to_image_start_and_noise_match_diffusers(name, steps, strength):
    """Strength picks the starting step as get_timesteps does; the image latents are noised by the
    scheduler's own rule at that step, and re-noised after each step (inpainting) at the next one."""
    if steps == 1 and "shift_terminal" in CONFIGS[name][1]:
        pytest.skip("one step cannot be stretched to a terminal shift: diffusers divides 0 by 0 there too")
    ref, ours = _pair(name)
    mu = ours.mu_for(64 * 48) if hasattr(ours, "mu_for") else None
    ref.set_timesteps(steps, **({"mu": mu} if mu is not None else {}))
    start = strength_start(steps, strength)  # SD3's get_timesteps; SD1.5's and SDXL's round down first:
    assert start == int(max(steps - min(steps * strength, steps), 0))
    assert strength_start(steps, strength, whole_steps=True) == max(steps - min(int(steps * strength), steps), 0)
    timesteps = ref.timesteps[start * ref.order:]
    if hasattr(ref, "set_begin_index"):
        ref.set_begin_index(start * ref.order)
    run = ours.start(steps, mu).begin_at(start)
    _close(run.timesteps, timesteps.numpy().astype(np.float32), "timesteps")
    if len(timesteps) == 0:
        return  # no step runs: the pipeline refuses this strength, as diffusers does
    rng = np.random.default_rng(steps)
    x0, noise = (rng.standard_normal((2, 4, 8, 8), dtype=np.float32) for _ in range(2))
    sample = _ref_noised(ref, x0, noise, timesteps[0])
    _close(run.noised(x0, noise), sample, "starting latents")
    for i, t in enumerate(timesteps):
        output = rng.standard_normal(sample.shape, dtype=np.float32)
        scaled = ref.scale_model_input(torch.from_numpy(sample), t).numpy() if hasattr(ref, "scale_model_input") \
            else sample
        _close(run.scale_model_input(sample, i), scaled, f"scaled input {i}")
        expected = ref.step(torch.from_numpy(output), t, torch.from_numpy(sample)).prev_sample.numpy()
        _close(run.step(output, i, sample), expected, f"step {i}")
        sample = expected
        if i + 1 < len(timesteps):
            _close(run.noised(x0, noise, i + 1), _ref_noised(ref, x0, noise, timesteps[i + 1]), f"re-noised {i + 1}")


@pytest.mark.parametrize("steps", [1, 2, 3, 8, 9, 28, 50])
def test_pipeline_sigmas(steps):
    """FluxPipeline's sigmas bit for bit; ZImagePipeline's (torch.linspace in float32, whose last bit follows the
    CPU's vector width) within one float32 rounding, once the scheduler takes them in float32."""
    from runners.schedulers.schedule import PIPELINE_SIGMAS

    ours = PIPELINE_SIGMAS["linspace"](steps)
    np.testing.assert_array_equal(ours, np.linspace(1.0, 1 / steps, steps))
    np.testing.assert_allclose(ours.astype(np.float32), torch.linspace(1.0, 1 / steps, steps).numpy(), rtol=1.2e-7)


@pytest.mark.parametrize("steps", [1, 4, 28, 50, 200])
def test_flux2_empirical_mu_is_diffusers(steps):
    """FLUX.2's shift of the schedule (pipeline.schedule.mu "empirical") against Flux2Pipeline's and
    Flux2KleinPipeline's compute_empirical_mu, on both sides of its 4300-token break."""
    from diffusers.pipelines.flux2 import pipeline_flux2, pipeline_flux2_klein

    from runners.schedulers.schedule import PIPELINE_MU

    for tokens in (16, 256, 1024, 4096, 4300, 4301, 16384):
        ours = PIPELINE_MU["empirical"](None, tokens, steps)
        for module in (pipeline_flux2, pipeline_flux2_klein):
            assert ours == module.compute_empirical_mu(image_seq_len=tokens, num_steps=steps), (tokens, steps)
