"""DDIMScheduler (eta = 0, the pipelines' default) in numpy."""
from __future__ import annotations

import numpy as np

from runners.schedulers.discrete import AlphaNoised, DiscreteNoise, DiscreteScheduler

OPTIONS = {"prediction_type": ("epsilon", "v_prediction")}


class _DDIMRun(AlphaNoised):
    def __init__(self, noise: DiscreteNoise, steps: int):
        self.noise, self.stride = noise, noise.n // steps
        self.ints = noise.spaced(steps)
        self.timesteps = self.ints.astype(np.float32)

    def step(self, model_output, i, sample):
        t = int(self.ints[i])
        a = self.noise.alphas_cumprod[t]
        a_prev = self.noise.alpha_prev(t - self.stride)
        b = np.float32(1) - a
        x0 = self.predicted_original(model_output, i, sample)
        eps = a**0.5 * model_output + b**0.5 * sample if self.noise.prediction_type == "v_prediction" else model_output
        return (a_prev**0.5 * x0 + (np.float32(1) - a_prev) ** 0.5 * eps).astype(np.float32)


class DDIM(DiscreteScheduler):
    options, run = OPTIONS, _DDIMRun
