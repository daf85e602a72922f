"""The DDPM noise schedule the discrete-time schedulers (PNDM, DDIM, Euler) share: betas, the
cumulative alphas, and the spacing of inference timesteps over the training ones, computed in
float32 in the order diffusers computes them."""
from __future__ import annotations

import numpy as np

from runners.schedulers.schedule import Schedule, check_steps, refuse

SPACINGS = ("leading", "linspace", "trailing")
# What every discrete port implements; each adds its own options to this.
COMMON_OPTIONS = {
    "beta_schedule": ("linear", "scaled_linear"),
    "trained_betas": (None,),
    "rescale_betas_zero_snr": (False,),
    "timestep_spacing": SPACINGS,
    "thresholding": (False,),
    "clip_sample": (False,),
}


class DiscreteNoise:
    def __init__(self, config: dict, options: dict):
        refuse(config, {**COMMON_OPTIONS, **options})
        self.config = config
        self.n = config.get("num_train_timesteps", 1000)
        self.steps_offset = config.get("steps_offset", 0)
        self.spacing = config.get("timestep_spacing", "leading")
        self.prediction_type = config.get("prediction_type", "epsilon")
        start, end = config.get("beta_start", 0.0001), config.get("beta_end", 0.02)
        if config.get("beta_schedule", "linear") == "scaled_linear":
            betas = np.linspace(start**0.5, end**0.5, self.n, dtype=np.float32) ** 2
        else:
            betas = np.linspace(start, end, self.n, dtype=np.float32)
        self.alphas_cumprod = np.cumprod(np.float32(1) - betas, dtype=np.float32)
        self.final_alpha_cumprod = np.float32(1.0) if config.get("set_alpha_to_one", True) else self.alphas_cumprod[0]

    def spaced(self, steps: int, ascending: bool = False) -> np.ndarray:
        """The integer timesteps of `steps` inference steps, descending (ascending for PNDM's layout)."""
        check_steps(steps, self.n)
        n = self.n
        if self.spacing == "linspace":
            t = np.linspace(0, n - 1, steps).round()
        elif self.spacing == "leading":
            t = (np.arange(0, steps) * (n // steps)).round() + self.steps_offset
        else:  # trailing
            t = np.round(np.arange(n, 0, -n / steps))[::-1] - 1
        t = t.astype(np.int64)
        return t if ascending else t[::-1].copy()

    def alpha_prev(self, prev_timestep: int) -> np.float32:
        return self.alphas_cumprod[prev_timestep] if prev_timestep >= 0 else self.final_alpha_cumprod


class AlphaNoised(Schedule):
    """A run over integer DDPM timesteps (`ints`), noised as DDPM's forward process (DDIM's and
    PNDM's add_noise): sqrt(alpha_cumprod) * sample + sqrt(1 - alpha_cumprod) * noise."""

    noise: DiscreteNoise
    ints: np.ndarray
    per_step = ("timesteps", "ints")

    def predicted_original(self, model_output, i, sample):
        a = self.noise.alphas_cumprod[int(self.ints[i])]
        b = np.float32(1) - a
        if self.noise.prediction_type == "v_prediction":
            return a**0.5 * sample - b**0.5 * model_output
        return (sample - b**0.5 * model_output) / a**0.5

    def noised(self, sample, noise, i=0):
        a = self.noise.alphas_cumprod[int(self.ints[i])]
        return (a**0.5 * sample + (np.float32(1) - a) ** 0.5 * noise).astype(np.float32)


class DiscreteScheduler:
    """A port over this noise schedule: `options` it implements beyond the common ones, and the
    `Schedule` class one run uses."""

    options: dict = {}
    run: type

    def __init__(self, config: dict):
        self.noise = DiscreteNoise(config, self.options)

    def start(self, num_inference_steps: int, mu=None):
        return self.run(self.noise, num_inference_steps)
