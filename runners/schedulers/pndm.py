"""PNDMScheduler with `skip_prk_steps` (Stable Diffusion 1.x's default: PLMS) in numpy.

PLMS runs one more denoiser call than steps: the second call revisits the first timestep to
build the two-point estimate, then each step combines up to four past outputs.
"""
from __future__ import annotations

import numpy as np

from runners.schedulers.discrete import AlphaNoised, DiscreteNoise, DiscreteScheduler

OPTIONS = {"prediction_type": ("epsilon", "v_prediction"), "skip_prk_steps": (True,)}


class _PLMSRun(AlphaNoised):
    def __init__(self, noise: DiscreteNoise, steps: int):
        self.noise, self.stride = noise, noise.n // steps
        t = noise.spaced(steps, ascending=True)
        self.ints = np.concatenate([t[:-1], t[-2:-1], t[-1:]])[::-1].copy()
        self.timesteps = self.ints.astype(np.float32)
        self.ets: list[np.ndarray] = []  # past denoiser outputs, newest last
        self.first_sample = None

    def step(self, model_output, i, sample):
        t = int(self.ints[i])
        prev = t - self.stride
        if i != 1:  # kept for later steps: a copy, as the denoiser's backend may reuse its output buffer
            self.ets = self.ets[-3:] + [model_output.copy()]
        else:  # the revisit of the first timestep
            prev, t = t, t + self.stride
        ets = self.ets
        if i == 0:
            eps, self.first_sample = model_output, sample
        elif i == 1:
            eps, sample = (model_output + ets[-1]) / 2, self.first_sample
        elif len(ets) == 2:
            eps = (3 * ets[-1] - ets[-2]) / 2
        elif len(ets) == 3:
            eps = (23 * ets[-1] - 16 * ets[-2] + 5 * ets[-3]) / 12
        else:
            eps = (1 / 24) * (55 * ets[-1] - 59 * ets[-2] + 37 * ets[-3] - 9 * ets[-4])
        return self._previous(sample, t, prev, eps)

    def _previous(self, sample, t, prev, eps):
        """Formula (9) of the PNDM paper: x_{t-delta} from x_t and the combined noise estimate."""
        a = self.noise.alphas_cumprod[t]
        a_prev = self.noise.alpha_prev(prev)
        b, b_prev = np.float32(1) - a, np.float32(1) - a_prev
        if self.noise.prediction_type == "v_prediction":
            eps = a**0.5 * eps + b**0.5 * sample
        sample_coeff = (a_prev / a) ** 0.5
        denom = a * b_prev**0.5 + (a * b * a_prev) ** 0.5
        return (sample_coeff * sample - (a_prev - a) * eps / denom).astype(np.float32)


class PNDM(DiscreteScheduler):
    options, run = OPTIONS, _PLMSRun
