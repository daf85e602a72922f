"""Guidance rules: how a family's pipeline combines the denoiser's predictions for the prompt and for
the negative prompt, as diffusers' guiders do. A rule says when it is on for a request, in which
order the two prompt batches go into the denoiser's batch (and so which order `combine` splits),
the cache contexts of that batch (Pipeline._evaluate), and the request options it reads.

The loop (runners/text_to_image.py) asks the family's `guidance` and nothing else. Guidance that is an
input of a guidance-distilled denoiser (FLUX.1 dev's embedded scale) is an `EmbeddedGuidance`: one more
condition, beside whichever rule the family has."""
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
                       allowed=f"a finite number (<= {self.threshold:g} turns classifier-free guidance off)"),
                *self.step_options)

    def on(self, scale: float) -> bool:
        return scale > self.threshold

    @property
    def step_options(self) -> tuple[Option, ...]:
        """The request options the rule reads at each step (beyond the scale), passed to `active` and `combine`."""
        return ()

    def batch(self, positive: np.ndarray, negative: np.ndarray) -> np.ndarray:
        """The denoiser's batch of both prompts' conditions, in the order `combine` splits it."""
        return np.concatenate([negative, positive])

    def positive(self, batched: np.ndarray) -> np.ndarray:
        """The prompt's half of a batch `batch` made (a step that runs without guidance)."""
        return np.split(batched, 2)[1]

    def active(self, scale: float, t_norm: float, **step_options) -> bool:
        """Whether the step at `t_norm` = (1000 - t) / 1000 runs both halves (else the prompt's alone)."""
        return self.on(scale)

    def combine(self, noise: np.ndarray, scale: float, **step_options) -> np.ndarray:
        uncond, cond = np.split(noise, 2)
        return uncond + np.float32(scale) * (cond - uncond)


@dataclass(frozen=True)
class NormalizedCFG(ClassifierFree):
    """ZImagePipeline's rule: the prompt's half first, cond + scale * (cond - uncond), on above 0;
    `cfg_normalization` caps each image's guided prediction at that multiple of its prompt prediction's
    norm, and `cfg_truncation` turns guidance off at the steps past that fraction of the schedule."""
    threshold: float = 0.0
    help: str = "classifier-free guidance scale (default: the variant's; 0 turns it off)"

    @property
    def step_options(self) -> tuple[Option, ...]:
        return (Option("cfg_normalization", "float", "cap each guided prediction's norm at this multiple of the "
                       "prompt's prediction's (0: no cap, diffusers' False; 1: its True)", default=0.0,
                       within=lambda v: v >= 0, allowed="a number >= 0 (0: no cap)"),
                Option("cfg_truncation", "float", "turn guidance off at the steps whose (1000 - t) / 1000 is above "
                       "this (1: never)", default=1.0, allowed="a number (above 1: never)"))

    def batch(self, positive: np.ndarray, negative: np.ndarray) -> np.ndarray:
        return np.concatenate([positive, negative])

    def positive(self, batched: np.ndarray) -> np.ndarray:
        return np.split(batched, 2)[0]

    def active(self, scale: float, t_norm: float, cfg_truncation: float = 1.0, **_) -> bool:
        # diffusers compares float32 (1000 - t) / 1000 with the option
        return self.on(scale) and not (float(cfg_truncation) <= 1 and t_norm > cfg_truncation)

    def combine(self, noise: np.ndarray, scale: float, cfg_normalization: float = 0.0, **_) -> np.ndarray:
        cond, uncond = np.split(noise, 2)
        guided = cond + np.float32(scale) * (cond - uncond)
        if cfg_normalization and float(cfg_normalization) > 0:
            axes = tuple(range(1, noise.ndim))
            most = np.sqrt((cond.astype(np.float32) ** 2).sum(axis=axes, keepdims=True)) * np.float32(cfg_normalization)
            norm = np.sqrt((guided ** 2).sum(axis=axes, keepdims=True))
            with np.errstate(divide="ignore", invalid="ignore"):  # a zero norm is never above the cap
                guided = np.where(norm > most, guided * (most / norm), guided).astype(np.float32)
        return guided


@dataclass(frozen=True)
class RescaledTrueCFG(ClassifierFree):
    """QwenImagePipeline's true CFG: uncond + scale * (cond - uncond), then each packed token of the guided
    prediction (a `patch` x `patch` square of the latents, every channel) rescaled to its norm in the
    prompt's prediction."""
    patch: int = 2

    def combine(self, noise: np.ndarray, scale: float, **step_options) -> np.ndarray:
        cond = np.split(noise, 2)[1]
        guided = super().combine(noise, scale)
        n, c, h, w = cond.shape
        tokens = (n, c, h // self.patch, self.patch, w // self.patch, self.patch)  # a packed token: axes 1, 3, 5

        def token_norms(x):
            return np.sqrt((x.reshape(tokens) ** 2).sum(axis=(1, 3, 5), keepdims=True))

        factor = token_norms(cond) / token_norms(guided)
        return (guided.reshape(tokens) * factor).reshape(cond.shape).astype(np.float32)


@dataclass(frozen=True)
class EmbeddedGuidance:
    """A guidance-distilled denoiser's scale as an input (FLUX.1 dev's `guidance`): the request option that
    holds it, and the feed, one value per row of the denoiser's batch (both halves of a classifier-free
    rule alike)."""
    option: Option
    feed: str = "guidance"

    def conditions(self, scale: float, batch: int) -> dict[str, np.ndarray]:
        return {self.feed: np.full(batch, scale, dtype=np.float32)}


# SD1.5, SDXL, SD3: `guidance_scale`, one batched call
BATCHED_CFG = ClassifierFree()
# FluxPipeline's true CFG: `true_cfg_scale` with a negative prompt, the halves as two cache contexts
# (diffusers calls the transformer twice; the runner batches the calls and keeps their contexts)
TRUE_CFG = ClassifierFree(scale_option="true_cfg_scale", contexts="uncond,cond", flag=None, default=1.0,
                          help="classifier-free guidance with a negative prompt, as diffusers' true_cfg_scale "
                               "(default 1: none; the negative prompt does nothing without a scale over 1)")
# QwenImagePipeline's: true_cfg_scale (default 4) with a negative prompt, the guided prediction rescaled
QWEN_TRUE_CFG = RescaledTrueCFG(scale_option="true_cfg_scale", contexts="uncond,cond", flag=None, default=4.0,
                                help="classifier-free guidance with a negative prompt, as diffusers' true_cfg_scale "
                                     "(default 4; 1 or no negative prompt: none), each token rescaled to the "
                                     "prompt's prediction's norm")
