"""UniPCMultistepScheduler in numpy, for the flow-matching configuration Wan 2.1 and 2.2 ship.

A port of diffusers' UniPC (the UniP predictor with the UniC corrector, B(h) as bh1 or bh2) for
`use_flow_sigmas` with `flow_prediction` and `predict_x0`: the schedule is FlowMatch's shifted sigmas
(by `flow_shift`, or by `mu` under dynamic shifting, or a pipeline's own), the model's velocity is
turned into an x0 prediction, and each step corrects the sample just reached with the new prediction
before predicting the next one from up to `solver_order` past predictions. The coefficients are
computed as diffusers computes them, in float32 from its float32 sigmas: their small-step series cancel,
and float64 ones measured twice as far from diffusers' results.
"""
from __future__ import annotations

import math

import numpy as np

from runners.schedulers.schedule import Schedule, check_steps, refuse

DEFAULTS = {"num_train_timesteps": 1000, "solver_order": 2, "prediction_type": "epsilon", "predict_x0": True,
            "thresholding": False, "solver_type": "bh2", "lower_order_final": True, "disable_corrector": [],
            "solver_p": None, "use_flow_sigmas": False, "flow_shift": 1.0, "timestep_spacing": "linspace",
            "final_sigmas_type": "zero", "use_dynamic_shifting": False, "time_shift_type": "exponential",
            "shift_terminal": None}
# The flow sigmas replace the spaced timesteps, so timestep_spacing (and steps_offset) change nothing; the
# betas (beta_*, trained_betas, rescale_betas_zero_snr) and sigma_min/sigma_max are not read for flow sigmas.
OPTIONS = {"use_flow_sigmas": (True,), "prediction_type": ("flow_prediction",), "predict_x0": (True,),
           "thresholding": (False,), "solver_p": (None,), "solver_type": ("bh1", "bh2"), "solver_order": (1, 2, 3),
           "final_sigmas_type": ("zero", "sigma_min"), "use_karras_sigmas": (False,),
           "use_exponential_sigmas": (False,), "use_beta_sigmas": (False,),
           "timestep_spacing": ("linspace", "leading", "trailing"), "time_shift_type": ("exponential", "linear")}


class UniPCMultistep:
    def __init__(self, config: dict):
        c = {**DEFAULTS, **config}
        refuse(c, OPTIONS)
        # diffusers' last step is NaN or inf where it is taken over an infinite log-SNR step (to sigma 0) by bh1
        # (B(h) = h) or by a multistep update, or over a zero one (sigma_min repeats the last sigma) at order 3.
        last_order = 1 if c["lower_order_final"] else c["solver_order"]
        if (c["solver_type"] == "bh1" or last_order > 1) if c["final_sigmas_type"] == "zero" else last_order > 2:
            raise ValueError("scheduler options not supported by the runner: " + ", ".join(
                f"{k}={c[k]!r}" for k in ("final_sigmas_type", "solver_type", "solver_order", "lower_order_final"))
                + " (diffusers' last step is NaN or inf there)")
        self.config = c

    def timesteps(self, num_inference_steps: int, mu: float | None = None,
                  sigmas: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(timesteps, sigmas) as set_timesteps makes them: the shift in float64, the timesteps its integers
        (truncated) as float32, the sigmas float32 and one longer."""
        c, n = self.config, self.config["num_train_timesteps"]
        check_steps(num_inference_steps, n)
        if sigmas is None:
            s = np.linspace(1, 1 / n, num_inference_steps + 1)[:-1]
        elif len(sigmas) != num_inference_steps:
            raise ValueError(f"{len(sigmas)} sigmas for num_inference_steps={num_inference_steps}: give one a step")
        else:
            s = np.array(sigmas, dtype=np.float64)
        if c["use_dynamic_shifting"]:
            if mu is None:
                raise ValueError("this scheduler uses dynamic shifting: pass mu")
            shift = math.exp(mu) if c["time_shift_type"] == "exponential" else mu
            s = shift / (shift + (1 / s - 1))
        else:
            s = c["flow_shift"] * s / (1 + (c["flow_shift"] - 1) * s)
        if c["shift_terminal"]:
            one_minus = 1 - s
            s = 1 - one_minus / (one_minus[-1] / (1 - c["shift_terminal"]))
        if abs(s[0] - 1) < 1e-6:  # diffusers' guard: sigma 1 has alpha 0, an infinite log-SNR
            s[0] -= 1e-6
        last = s[-1] if c["final_sigmas_type"] == "sigma_min" else 0.0
        return (s * n).astype(np.int64).astype(np.float32), np.append(s, last).astype(np.float32)

    def start(self, num_inference_steps: int, mu: float | None = None, sigmas: np.ndarray | None = None) -> Schedule:
        return _UniPCRun(*self.timesteps(num_inference_steps, mu, sigmas), self.config)


class _UniPCRun(Schedule):
    per_step = ("timesteps", "sigmas")

    def __init__(self, timesteps: np.ndarray, sigmas: np.ndarray, config: dict):
        self.timesteps, self.sigmas, self.c = timesteps, sigmas, config
        self.first = 0  # the step `begin_at` started from: disable_corrector counts steps from the first
        self.x0s: list[np.ndarray] = []  # the last solver_order x0 predictions, newest last
        self.last_sample, self.order = None, 0  # the sample and order of the last prediction, which UniC corrects

    def begin_at(self, start: int) -> Schedule:
        self.first += start
        return super().begin_at(start)

    def noised(self, sample, noise, i=0):
        """diffusers' add_noise for flow sigmas: alpha = 1 - sigma, sigma."""
        sigma = self.sigmas[i]
        return ((np.float32(1) - sigma) * sample + sigma * noise).astype(np.float32)

    def predicted_original(self, model_output, i, sample):
        return (sample - self.sigmas[i] * model_output).astype(np.float32)

    def step(self, model_output, i, sample):
        x0 = self.predicted_original(model_output, i, sample)
        if self.last_sample is not None and self.first + i - 1 not in self.c["disable_corrector"]:
            sample = self._update(self.last_sample, i, self.order, x0)  # UniC: redo the last step with x0 known
        self.x0s = (self.x0s + [x0])[-self.c["solver_order"]:]
        order = self.c["solver_order"]
        if self.c["lower_order_final"]:  # diffusers' stabilizer (and the step to sigma 0 is infinite in log-SNR)
            order = min(order, len(self.timesteps) - i)
        self.order = min(order, len(self.x0s))  # and the first ones have too little history
        self.last_sample = sample
        return self._update(sample, i + 1, self.order)

    # The last step's h may be infinite or 0 (see __init__): the NaN coefficients it then gives go unused.
    @np.errstate(divide="ignore", invalid="ignore")
    def _update(self, x, t, order, x0_t=None):
        """The sample at sigma index `t` from `x` at t - 1, using `order` x0 predictions (the newest at t - 1):
        UniP's prediction, or with `x0_t` (the prediction at t) UniC's correction. diffusers'
        multistep_uni_p_bh_update and multistep_uni_c_bh_update, in float32."""
        one, sigmas, m0 = np.float32(1), self.sigmas, self.x0s[-1]
        lam = [np.log(one - sigmas[k]) - np.log(sigmas[k]) for k in range(t - order, t + 1)][::-1]
        h = lam[0] - lam[1]  # lam[k]: the log-SNR k steps back from t
        rks = [(lam[k + 1] - lam[1]) / h for k in range(1, order)]
        d1s = [(self.x0s[-1 - k] - m0) / rk for k, rk in zip(range(1, order), rks)]
        hh = -h
        h_phi_1 = np.expm1(hh)
        b_h = hh if self.c["solver_type"] == "bh1" else h_phi_1
        b, h_phi_k, factorial = [], h_phi_1 / hh - 1, 1
        for k in range(1, order + 1):
            b.append(h_phi_k * factorial / b_h)
            factorial *= k + 1
            h_phi_k = h_phi_k / hh - 1 / factorial
        rk_powers = np.array([np.power(np.array(rks + [one]), k) for k in range(order)], dtype=np.float32)
        b = np.array(b, dtype=np.float32)
        alpha_t = one - sigmas[t]
        x_t = sigmas[t] / sigmas[t - 1] * x - alpha_t * h_phi_1 * m0
        if x0_t is None:  # UniP: order 1 has no terms, order 2 fixes its one weight at 1/2
            rhos = np.linalg.solve(rk_powers[:-1, :-1], b[:-1]) if order > 2 else [np.float32(0.5)] * (order - 1)
            terms = [r * d for r, d in zip(rhos, d1s)]
        else:  # UniC adds the step's own difference; order 1 fixes its weight at 1/2
            rhos = [np.float32(0.5)] if order == 1 else np.linalg.solve(rk_powers, b)
            terms = [r * d for r, d in zip(rhos[:-1], d1s)] + [rhos[-1] * (x0_t - m0)]
        if terms:
            x_t = x_t - alpha_t * b_h * sum(terms[1:], terms[0])
        return x_t.astype(np.float32)
