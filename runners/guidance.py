"""Guidance rules: how a family's pipeline combines the denoiser's predictions for the prompt and for
the negative prompt, as diffusers' guiders do. A rule says when it is on for a request, in which
order the two prompt batches go into the denoiser's batch (and so which order `combine` splits),
the cache contexts of that batch (Pipeline._evaluate), and the request options it reads.

The loop (runners/text_to_image.py) asks the family's `guidance` and nothing else; a family without
classifier-free guidance (a distilled model) has `NoGuidance()`. Guidance that is an input of the
denoiser (FLUX.1 dev's embedded scale) is a condition of the family, not a rule here."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runners.options import Option


@dataclass(frozen=True)
class ClassifierFree:
    """uncond + scale * (cond - uncond), on above `threshold`, both halves in one denoiser batch with
    the negative half first (diffusers' SD pipelines: one cache context for the batch)."""
    scale_option: str = "guidance_scale"  # the request option that holds the scale
    threshold: float = 1.0  # on when the scale is above it
    contexts: str = "batch"  # the cache contexts of the batch: one, or "uncond,cond" (one per half)
    help: str = "classifier-free guidance scale (default: diffusers' for the family and task; <= 1 turns it off)"
    flag: str | None = "--guidance"
    default: float | None = None  # None: the family's default for the task

    @property
    def options(self) -> tuple[Option, ...]:
        return (Option(self.scale_option, "float", self.help, default=self.default, flag=self.flag,
                       allowed="a finite number (<= 1 turns classifier-free guidance off)"),)

    def on(self, scale: float) -> bool:
        return scale > self.threshold

    def batch(self, positive: np.ndarray, negative: np.ndarray) -> np.ndarray:
        """The denoiser's batch of both prompts' conditions, in the order `combine` splits it."""
        return np.concatenate([negative, positive])

    def combine(self, noise: np.ndarray, scale: float) -> np.ndarray:
        uncond, cond = np.split(noise, 2)
        return uncond + np.float32(scale) * (cond - uncond)


# SD1.5, SDXL, SD3: `guidance_scale`, one batched call
BATCHED_CFG = ClassifierFree()
# FluxPipeline's true CFG: `true_cfg_scale` with a negative prompt, the halves as two cache contexts
# (diffusers calls the transformer twice; the runner batches the calls and keeps their contexts)
TRUE_CFG = ClassifierFree(scale_option="true_cfg_scale", contexts="uncond,cond", flag=None, default=1.0,
                          help="classifier-free guidance with a negative prompt, as diffusers' true_cfg_scale "
                               "(default 1: none; the negative prompt does nothing without a scale over 1)")
