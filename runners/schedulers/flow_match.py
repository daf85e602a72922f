"""FlowMatchEulerDiscreteScheduler in numpy, driven by the artifact's scheduler_config.json.

A port of diffusers' scheduler for the options SD3, SD3.5 and FLUX.1 configs use (shift, dynamic
shifting, shift_terminal, a pipeline's own sigmas).
"""
from __future__ import annotations

import math

import numpy as np

from runners.schedulers.schedule import Schedule, check_steps

_UNSUPPORTED = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas",
                "stochastic_sampling")


class FlowMatchEulerDiscrete:
    def __init__(self, config: dict):
        on = [k for k in _UNSUPPORTED if config.get(k)]
        if on:
            raise ValueError(f"scheduler options not supported by the runner: {', '.join(on)}")
        self.config = config
        self.num_train_timesteps = config.get("num_train_timesteps", 1000)
        self.shift = config.get("shift", 1.0)
        # The training schedule's end points, computed in float32 exactly as diffusers does.
        n = self.num_train_timesteps
        sigmas = np.linspace(1, n, n, dtype=np.float32)[::-1] / np.float32(n)
        if not config.get("use_dynamic_shifting"):
            s = np.float32(self.shift)
            sigmas = s * sigmas / (1 + (s - 1) * sigmas)
        self.sigma_min, self.sigma_max = float(sigmas[-1]), float(sigmas[0])

    def mu_for(self, tokens: int) -> float | None:
        """The resolution-dependent shift of SD3.5-style configs for latents of `tokens` patches (None when not
        configured)."""
        if not self.config.get("use_dynamic_shifting"):
            return None
        c = self.config
        base_len, max_len = c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096)
        base_shift, max_shift = c.get("base_shift", 0.5), c.get("max_shift", 1.16)
        m = (max_shift - base_shift) / (max_len - base_len)
        return tokens * m + base_shift - m * base_len

    def timesteps(self, num_inference_steps: int, mu: float | None = None,
                  sigmas: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(timesteps, sigmas): float32, sigmas one longer and ending in 0. `sigmas`: a pipeline's own
        unshifted ones (FluxPipeline's), in place of the training schedule's, taken in float32 as
        diffusers takes them."""
        check_steps(num_inference_steps, self.num_train_timesteps)
        n = self.num_train_timesteps
        if sigmas is None:
            sigmas = np.linspace(self.sigma_max * n, self.sigma_min * n, num_inference_steps) / n
        elif len(sigmas) != num_inference_steps:
            raise ValueError(f"{len(sigmas)} sigmas for num_inference_steps={num_inference_steps}: give one a step")
        else:
            sigmas = np.asarray(sigmas, dtype=np.float32)
        if self.config.get("use_dynamic_shifting"):
            if mu is None:
                raise ValueError("this scheduler uses dynamic shifting: pass mu")
            if self.config.get("time_shift_type", "exponential") == "exponential":
                sigmas = math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1))
            else:
                sigmas = mu / (mu + (1 / sigmas - 1))
        else:
            sigmas = self.shift * sigmas / (1 + (self.shift - 1) * sigmas)
        terminal = self.config.get("shift_terminal")
        if terminal:
            if len(sigmas) < 2:  # the stretch divides by the last sigma's distance from 1: 0 for one step
                raise ValueError(f"num_inference_steps={len(sigmas)} cannot be stretched to this scheduler's "
                                 f"shift_terminal {terminal} (diffusers makes NaN timesteps there and fails): use 2 "
                                 "steps or more")
            one_minus = 1 - sigmas
            sigmas = 1 - one_minus / (one_minus[-1] / (1 - terminal))
        sigmas = sigmas.astype(np.float32)
        timesteps = sigmas * np.float32(n)
        return timesteps, np.append(sigmas, np.float32(0.0))

    def start(self, num_inference_steps: int, mu: float | None = None, sigmas: np.ndarray | None = None) -> Schedule:
        return _FlowRun(*self.timesteps(num_inference_steps, mu, sigmas))


class _FlowRun(Schedule):
    per_step = ("timesteps", "sigmas")

    def __init__(self, timesteps: np.ndarray, sigmas: np.ndarray):
        self.timesteps, self.sigmas = timesteps, sigmas

    def noised(self, sample, noise, i=0):
        """diffusers' scale_noise: the straight path between the sample and the noise, at sigma."""
        sigma = self.sigmas[i]
        return (sigma * noise + (np.float32(1) - sigma) * sample).astype(np.float32)

    def predicted_original(self, model_output, i, sample):
        return (sample - self.sigmas[i] * model_output).astype(np.float32)

    def step(self, model_output, i, sample):
        """One Euler step of the flow ODE (sample + (sigma_next - sigma) * velocity), in float32."""
        return (sample + np.float32(self.sigmas[i + 1] - self.sigmas[i]) * model_output).astype(sample.dtype)
