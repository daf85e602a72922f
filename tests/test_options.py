"""Request options declared once (runners/options.py): each family's declarations are its call's
keywords (names and defaults), `pipe(...)` checks keywords against them, and the CLI's flags and the
Triton model's inputs are made from them."""
from __future__ import annotations

import inspect
import re

import pytest

from runners.__main__ import all_options
from runners.options import check_call, declared
from runners.pipeline import FAMILIES
from runners.serving.requests import SERVER_INPUTS, inputs_for


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_declarations_are_the_calls_keywords_with_their_defaults(family):
    cls = FAMILIES[family]
    parameters = {n: p.default for n, p in inspect.signature(cls.generate).parameters.items() if n != "self"}
    options = declared(cls)
    assert set(parameters) == set(options)
    assert {n: d for n, d in parameters.items() if d is not inspect.Parameter.empty} == \
        {n: options[n].default for n in parameters if parameters[n] is not inspect.Parameter.empty}


BAD = [  # (keywords, what the error says)
    (dict(num_inference_step=4), "num_inference_step= is not an option of this sd3 artifact (did you mean "
                                 "num_inference_steps?); it takes: "),
    (dict(true_cfg_scale=3.0), "true_cfg_scale= is not an option of this sd3 artifact; it takes: "),
    (dict(seed=2**63), "seed=9223372036854775808 is not allowed: use an integer from 0 to 2**63 - 1"),
    (dict(seed=1.5), "seed=1.5 is not allowed: use an integer"),
    (dict(guidance_scale="7"), "guidance_scale='7' is not allowed: use a finite number"),
    (dict(strength=0.0), r"strength=0.0 is not allowed: use a number in (0, 1]"),
    (dict(vae_tiling="yes"), "vae_tiling='yes' is not allowed: use True or False"),
    (dict(num_images_per_prompt=True), "num_images_per_prompt=True is not allowed: use an integer >= 1"),
    (dict(controlnet_conditioning_scale=[1.0, float("nan")]), "controlnet_conditioning_scale=.* is not allowed"),
]


@pytest.mark.parametrize("keywords,said", BAD, ids=[next(iter(k)) + str(i) for i, (k, _) in enumerate(BAD)])
def test_a_call_is_checked_against_the_declarations(keywords, said):
    with pytest.raises(ValueError, match=said if ".*" in said else re.escape(said)):
        check_call(FAMILIES["sd3"], keywords)


def test_good_calls_pass():
    check_call(FAMILIES["flux"], dict(prompt=["a", "b"], true_cfg_scale=3, control_mode=[0, None], seed=0,
                                      auto_resize=False, guidance_scale=3.5))
    check_call(FAMILIES["sdxl"], dict(original_size=(64, 64), aesthetic_score=6, guess_mode=True))


def test_the_cli_flags_are_the_declared_options_under_their_spellings():
    flags = {o.name: o.cli_flag for o in all_options()}
    assert {"num_inference_steps": "--steps", "guidance_scale": "--guidance", "num_images_per_prompt": "--num-images",
            "mask_image": "--mask", "controlnet_conditioning_scale": "--control-scale",
            "true_cfg_scale": "--true-cfg-scale"}.items() <= flags.items()
    assert not {"latents", "noise", "original_size", "control_noise"} & set(flags)  # arrays: Python only


def test_the_triton_inputs_are_the_served_declared_options():
    manifest = {"model": {"family": "sd3"}, "submodules": {"transformer": {}, "vae_encoder": {}}}
    inputs = {t.name: t for t in inputs_for(manifest)}
    assert {"prompt", "negative_prompt", "height", "width", "num_inference_steps", "guidance_scale", "seed",
            "num_images_per_prompt", "image", "mask_image", "strength", "max_sequence_length"} <= set(inputs)
    assert (inputs["seed"].data_type, inputs["image"].dims, inputs["mask_image"].dims) == \
        ("TYPE_INT64", (-1, -1, 3), (-1, -1))
    assert not inputs["prompt"].optional and "true_cfg_scale" not in inputs
    assert set(SERVER_INPUTS) <= set(inputs.values())
    without_encoder = {t.name for t in inputs_for({**manifest, "submodules": {"transformer": {}}})}
    assert not {"image", "mask_image", "strength"} & without_encoder
