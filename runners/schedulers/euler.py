"""EulerDiscreteScheduler (SDXL's default) in numpy: the deterministic Euler method over the
Karras-style sigmas of the DDPM schedule (s_churn = 0, as the pipelines call it)."""
from __future__ import annotations

import numpy as np

from runners.schedulers.discrete import DiscreteNoise, DiscreteScheduler
from runners.schedulers.schedule import Schedule

OPTIONS = {
    "prediction_type": ("epsilon", "v_prediction"),
    "interpolation_type": ("linear",),
    "use_karras_sigmas": (False,), "use_exponential_sigmas": (False,), "use_beta_sigmas": (False,),
    "timestep_type": ("discrete",),
    "final_sigmas_type": ("zero",),
}


class _EulerRun(Schedule):
    per_step = ("timesteps", "sigmas")

    def __init__(self, noise: DiscreteNoise, steps: int):
        self.noise = noise
        ac = noise.alphas_cumprod
        train_sigmas = ((1 - ac) / ac) ** 0.5  # float32, as diffusers computes them
        if noise.spacing == "linspace":  # diffusers' Euler spaces linspace in float, unrounded
            t = np.linspace(0, noise.n - 1, steps, dtype=np.float32)[::-1].copy()
        else:
            t = noise.spaced(steps).astype(np.float32)
        sigmas = np.interp(t, np.arange(len(train_sigmas)), train_sigmas)
        self.sigmas = np.concatenate([sigmas, [0.0]]).astype(np.float32)
        self.timesteps = t.astype(np.float32)
        top = self.sigmas.max()
        self.init_noise_sigma = float(top if noise.spacing in ("linspace", "trailing") else (top**2 + 1) ** 0.5)

    def scale_model_input(self, sample, i):
        return sample / (self.sigmas[i] ** 2 + 1) ** 0.5

    def noised(self, sample, noise, i=0):
        return (sample + noise * self.sigmas[i]).astype(np.float32)

    def predicted_original(self, model_output, i, sample):
        sigma = self.sigmas[i]
        if self.noise.prediction_type == "v_prediction":
            return model_output * (-sigma / (sigma**2 + 1) ** 0.5) + sample / (sigma**2 + 1)
        return sample - sigma * model_output

    def step(self, model_output, i, sample):
        sigma = self.sigmas[i]
        derivative = (sample - self.predicted_original(model_output, i, sample)) / sigma
        return (sample + derivative * (self.sigmas[i + 1] - sigma)).astype(np.float32)


class EulerDiscrete(DiscreteScheduler):
    options, run = OPTIONS, _EulerRun
