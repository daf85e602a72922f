"""What a scheduler hands the denoising loop for one generation."""
from __future__ import annotations

import numpy as np


# A pipeline's own sigmas for n steps, in place of its scheduler's, by the rule the artifact's manifest names
# (`pipeline.schedule.sigmas`; none: the scheduler's): from 1 to 1/n, as FluxPipeline computes them (numpy,
# float64) and ZImagePipeline nearly so (torch.linspace in float32, whose last bit depends on the CPU's
# vector width: within one float32 rounding of these).
PIPELINE_SIGMAS = {"linspace": lambda n: np.linspace(1.0, 1 / n, n)}


def empirical_mu(image_tokens: int, num_steps: int) -> float:
    """FLUX.2's shift (Flux2Pipeline's and Flux2KleinPipeline's compute_empirical_mu): two lines in the image's
    token count, fitted at 10 and 200 steps, and between them a line in the step count; past 4300 tokens the
    200-step line alone."""
    at_200 = 0.00016927 * image_tokens + 0.45666666
    if image_tokens > 4300:
        return float(at_200)
    at_10 = 8.73809524e-05 * image_tokens + 1.89833333
    slope = (at_200 - at_10) / 190.0
    return float(slope * num_steps + (at_200 - 200.0 * slope))


# A pipeline's shift of its schedule by the image's size ("mu"), by the rule the manifest names
# (`pipeline.schedule.mu`; none: no shift): (scheduler, the latents' tokens, steps) -> mu. "linear": the scheduler
# config's, in the image's (a video's: all its frames') tokens (None where the config has no dynamic shifting:
# SD3-medium, FLUX.1 schnell); "empirical": FLUX.2's, in its tokens and the step count.
PIPELINE_MU = {
    "linear": lambda scheduler, tokens, steps: scheduler.mu_for(tokens),
    "empirical": lambda scheduler, tokens, steps: empirical_mu(tokens, steps),
}


class Schedule:
    """The timesteps of one run and the update between them. `step` is called once per timestep,
    in order; multistep schedulers (PNDM) keep their history on the instance."""

    timesteps: np.ndarray  # float32: what the denoiser's `timestep` input receives at each step
    init_noise_sigma: float = 1.0  # the starting latents are standard normal times this
    per_step: tuple[str, ...] = ("timesteps",)  # the arrays indexed by step, which `begin_at` shortens

    def scale_model_input(self, sample: np.ndarray, i: int) -> np.ndarray:
        return sample

    def step(self, model_output: np.ndarray, i: int, sample: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def predicted_original(self, model_output: np.ndarray, i: int, sample: np.ndarray) -> np.ndarray:
        """The clean latents the denoiser's output at step `i` predicts (x0; live previews show it)."""
        raise NotImplementedError

    def noised(self, sample: np.ndarray, noise: np.ndarray, i: int = 0) -> np.ndarray:
        """`sample` with `noise` mixed in at the noise level of step `i`, by the scheduler's own rule
        (flow matching's `scale_noise`, the others' `add_noise`): image-to-image's starting latents
        (i = 0), and inpainting's original latents re-noised for the next step."""
        raise NotImplementedError

    def begin_at(self, start: int) -> "Schedule":
        """This run from step `start` on, as image-to-image runs it (diffusers' `get_timesteps` and
        `set_begin_index`): the step indices of `step`, `scale_model_input` and `noised` count from it."""
        for name in self.per_step:
            setattr(self, name, getattr(self, name)[start:])
        return self


def strength_start(num_inference_steps: int, strength: float, whole_steps: bool = False) -> int:
    """The first step image-to-image runs at `strength` (diffusers' get_timesteps): the run skips
    the noisiest (1 - strength) of the schedule. `whole_steps`: the steps kept are rounded down
    first, as the SD1.5 and SDXL pipelines do (SD3's round the steps skipped down instead)."""
    kept = num_inference_steps * strength
    kept = min(int(kept) if whole_steps else kept, num_inference_steps)
    return int(max(num_inference_steps - kept, 0))


def refuse(config: dict, allowed: dict) -> None:
    """Raise on options set to a value this port does not implement: {option: allowed values}."""
    bad = {k: config[k] for k, values in allowed.items() if k in config and config[k] not in values}
    if bad:
        raise ValueError(f"scheduler options not supported by the runner: "
                         + ", ".join(f"{k}={v!r} (supported: {allowed[k]})" for k, v in bad.items()))


def check_steps(num_inference_steps, num_train_timesteps: int) -> None:
    """1 to the scheduler's training timesteps, as diffusers allows: past that, spaced schedules
    repeat timesteps (PNDM's stride becomes 0) and the run is silently wrong."""
    if isinstance(num_inference_steps, bool) or not isinstance(num_inference_steps, (int, np.integer)) or not (
            1 <= num_inference_steps <= num_train_timesteps):
        raise ValueError(f"num_inference_steps={num_inference_steps!r} is not allowed: use an integer from 1 to "
                         f"{num_train_timesteps} (the scheduler's num_train_timesteps)")
