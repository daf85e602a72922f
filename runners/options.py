"""Request options, declared once by the step that reads them (the loop, a guidance rule, the image
tasks, the ControlNets, a family's text encoders), and read from those declarations by everything
that takes a request: `pipe(prompt, **options)` checks its keywords against them, the CLI makes its
flags from them (runners/__main__.py), and the servers their fields (Triton's inputs in
runners/serving/requests.py, the OpenAI-compatible images API in runners/serving/openai_api.py).

A pipeline's options are its class's `options` (`declared(pipe)`): the components it is made of add
theirs. The Python surface keeps diffusers' argument names; the CLI keeps its own older spellings
where they predate this (`--steps`, `--guidance`), recorded as an option's `flag`."""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

# What a value of each kind is, for the CLI's parsing and the servers' fields. "image" is a PIL image
# (the CLI reads a file, a server decodes one), "mask" a grayscale one, "array" a numpy array and
# "pairs" a tuple of (height, width) numbers, which the Python API alone takes.
KINDS = ("text", "int", "float", "bool", "image", "mask", "array", "pairs")


# What the error says a value of each kind must be, where the option says nothing more precise.
_ALLOWED = {"text": "a string or a non-empty list of strings", "int": "an integer", "float": "a finite number", "bool": "True or False"}


@dataclass(frozen=True)
class Option:
    name: str  # the keyword of `pipe(...)`: diffusers' argument name
    kind: str  # one of KINDS
    help: str
    default: Any = None  # None: unset, the family's default for the task (the help says which)
    flag: str | None = None  # the CLI's spelling where it is not --name-with-dashes
    repeat: bool = False  # one value per ControlNet: a list in Python, a repeated CLI flag
    # The values allowed beyond the kind, and the words an error says them in. Ranges that depend on the
    # artifact (sizes, text lengths, steps) are checked by the step that reads them, which knows it.
    within: Callable[[Any], bool] | None = None
    allowed: str | None = None
    cli: bool = True  # the CLI and the servers take it (arrays and pairs are the Python API's only)
    wide: bool = False  # an integer past 32 bits (a seed): a server's field is 64-bit
    # The step that reads it, where a server takes it only with that step: "image" (an artifact with a VAE
    # encoder), "controlnet" (an artifact with ControlNets)
    group: str = ""

    def __post_init__(self):
        assert self.kind in KINDS, self.kind

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    def check(self, value) -> None:
        """A ValueError naming the option and what it allows, for a value of the wrong kind or range.
        None is always allowed (unset)."""
        if value is None or self.kind not in _ALLOWED:
            return
        values = value if self.repeat and isinstance(value, (list, tuple)) else [value]
        values = [v for v in values if v is not None]  # a ControlNet's entry left unset
        if not all(self._kind_ok(v) and (self.within is None or self.within(v)) for v in values):
            allowed = self.allowed or _ALLOWED[self.kind]
            raise ValueError(f"{self.name}={value!r:.60} is not allowed: use {allowed}")

    def _kind_ok(self, v) -> bool:
        if self.kind == "text":
            return isinstance(v, str) or _texts(v)
        if self.kind == "bool":
            return isinstance(v, (bool, np.bool_))
        integer = isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
        return integer or (self.kind == "float" and isinstance(v, (float, np.floating)) and math.isfinite(v))


def _texts(value) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, str) for v in value)


def options(*groups) -> tuple[Option, ...]:
    """The options of several steps as one tuple, each name once (a later step's declaration of a name
    replaces an earlier one: a family's own help for `guidance_scale`, say)."""
    by_name: dict[str, Option] = {}
    for group in groups:
        for option in group:
            by_name[option.name] = option
    return tuple(by_name.values())


def declared(pipe) -> dict[str, Option]:
    """{name: Option} of what `pipe` (a Pipeline, or its class) takes in a call."""
    return {o.name: o for o in pipe.options}


def check_call(pipe, kwargs: dict) -> None:
    """Every keyword of a call is one of the pipeline's declared options, with a value of its kind: a
    ValueError naming the keyword and what is allowed (or the close spelling it was meant to be)."""
    known = declared(pipe)
    for name, value in kwargs.items():
        option = known.get(name)
        if option is None:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"{name}= is not an option of this {pipe.family} artifact{hint}; it takes: "
                             f"{', '.join(sorted(known))}")
        option.check(value)


# --- the loop's options: every family's request (runners/text_to_image.py reads them) ---------------

PROMPT = Option("prompt", "text", "the prompt, or a list of prompts (one batch)")
REQUEST = (
    PROMPT,
    Option("negative_prompt", "text", "what the images should not show (one, or one per prompt); used with "
           "guidance"),
    Option("height", "int", "image height in pixels (default: the artifact's opt size; image to image: the "
           "image's own for SD1.5 and SDXL)"),
    Option("width", "int", "image width in pixels"),
    Option("num_inference_steps", "int", "denoising steps (default: diffusers' for the family and task)",
           flag="--steps"),
    Option("num_images_per_prompt", "int", "images per prompt", default=1, within=lambda v: v >= 1,
           allowed="an integer >= 1", flag="--num-images"),
    Option("seed", "int", "seed of numpy's generator (not torch's noise: pass latents= for exact comparison)",
           within=lambda v: 0 <= v < 2**63, allowed="an integer from 0 to 2**63 - 1, or None for a random one",
           wide=True),
    Option("latents", "array", "the starting noise, as diffusers' pipeline of the family takes it", cli=False),
    Option("output_type", "text", "pil, np or latent", default="pil", cli=False),
    Option("vae_tiling", "bool", "decode in overlapping tiles even when the image fits the VAE engine (automatic "
           "when it does not)"),
)
# Image to image and inpainting (with a VAE encoder in the artifact)
IMAGE_TASKS = (
    Option("image", "image", "image to image: start from this image", group="image"),
    Option("mask_image", "mask", "with image: inpainting, repaint the mask's white part", flag="--mask",
           group="image"),
    Option("strength", "float", "with image: how much to change it, in (0, 1] (default: diffusers' for the family "
           "and task)", within=lambda v: 0 < v <= 1, allowed="a number in (0, 1] (1 ignores the image's content "
           "and keeps its size; lower keeps more of it)", group="image"),
    Option("noise", "array", "image tasks: the noise added to the image's latents", cli=False, group="image"),
    Option("encoder_noise", "array", "image tasks: the VAE posterior's sample noise", cli=False, group="image"),
)
MAX_SEQUENCE_LENGTH = Option("max_sequence_length", "int", "T5 tokens (default: SD3 256, FLUX.1 dev 512, "
                             "schnell 256)")
