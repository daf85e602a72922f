"""FLUX.1 against diffusers' FluxPipeline, FluxImg2ImgPipeline and FluxInpaintPipeline on flux-tiny
(dev: a guidance embedding, shifted sigmas) and flux-schnell-tiny (no guidance input, no shift): the
same weights, the same packed latents (or image noise), fp32. (FLUX.1 Fill, Canny/Depth and Kontext:
tests/test_flux_conditioned.py.) Images must agree within 1/255; the errors measured are printed (about 5e-6)."""
from __future__ import annotations

import logging
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import assert_real_image, compare_flux_image_task, flux_packed_latents, manifest, smooth_image
from runners import Pipeline

BOUND = 1 / 255  # of [0, 1] image values
LONG_PROMPT = "a watercolor painting of a red fox sitting in a snowy forest at dawn, soft light, mist between the trees"

# name: (build, request). Few steps, small images, short T5 texts: the cases differ in what they exercise.
CASES = {
    "guidance_embedding": ("dev", dict(height=128, width=128, guidance_scale=5.0, num_inference_steps=3,
                                       max_sequence_length=32)),
    # schnell's defaults (4 steps, 256 T5 tokens), passed to diffusers, whose defaults are dev's
    "no_guidance_schnell_defaults": ("schnell", dict(height=64, width=64)),
    "true_cfg_negative_prompt": ("dev", dict(height=64, width=64, negative_prompt="blurry, dark", true_cfg_scale=4.0,
                                             num_inference_steps=3, max_sequence_length=32)),
    "non_square": ("dev", dict(height=80, width=144, num_inference_steps=3, max_sequence_length=32)),
    "two_per_prompt_two_prompts": ("schnell", dict(prompt=["a photo of a cat", "a red car"], num_images_per_prompt=2,
                                                   height=64, width=64, num_inference_steps=2, max_sequence_length=16)),
    "short_max_sequence_length": ("dev", dict(prompt=LONG_PROMPT, height=64, width=64, num_inference_steps=2,
                                              max_sequence_length=8)),
}
SCHNELL_DEFAULTS = dict(num_inference_steps=4, max_sequence_length=256, guidance_scale=0.0)


@pytest.fixture(scope="module")
def builds(flux_tiny_build, flux_schnell_tiny_build):
    return {"dev": flux_tiny_build, "schnell": flux_schnell_tiny_build}


@pytest.fixture(scope="module")
def references(builds):
    """diffusers' pipelines of each build, loaded once: {(variant, class name): pipeline}."""
    import diffusers

    loaded = {}

    def get(variant, name="FluxPipeline"):
        if (variant, name) not in loaded:
            pipe = getattr(diffusers, name).from_pretrained(builds[variant].source.folder)
            pipe.set_progress_bar_config(disable=True)
            loaded[variant, name] = pipe
        return loaded[variant, name]

    return get


@pytest.fixture(scope="module")
def pipes(builds):
    return {variant: Pipeline.load(build.folder / "ort-fp32") for variant, build in builds.items()}


@pytest.mark.parametrize("case", CASES)
def test_text_to_image_matches_diffusers(pipes, references, caplog, case):
    variant, request = CASES[case]
    request = {"prompt": "a photo of a cat", **request}
    prompts = [request["prompt"]] if isinstance(request["prompt"], str) else request["prompt"]
    n = len(prompts) * request.get("num_images_per_prompt", 1)
    latents = flux_packed_latents(n, request["height"], request["width"], seed=len(case))
    reference_request = {**SCHNELL_DEFAULTS, **request} if case == "no_guidance_schnell_defaults" else request
    ref = references(variant)(latents=torch.from_numpy(latents), output_type="np", **reference_request).images
    with caplog.at_level(logging.WARNING, logger="runners"):
        ours = pipes[variant](latents=latents, output_type="np", **request)
    assert ours.shape == ref.shape == (n, request["height"], request["width"], 3)
    print(f"{case}: max abs error {np.abs(ours - ref).max():.1e}")
    assert np.abs(ours - ref).max() <= BOUND
    assert_real_image(ref)
    if case == "short_max_sequence_length":  # T5 cut the prompt at 8 tokens, and said so
        assert "tokenizer_2: the following part of the prompt was truncated to 8 tokens" in caplog.text


def test_true_cfg_changes_the_image_and_needs_a_negative_prompt(pipes):
    """Guidance runs only with a negative prompt (diffusers' do_true_cfg), and then changes the image."""
    pipe = pipes["dev"]
    latents = flux_packed_latents(1, 64, 64, seed=1)
    run = lambda **kw: pipe("a photo of a cat", latents=latents, height=64, width=64, num_inference_steps=2,
                            max_sequence_length=16, output_type="np", **kw)
    plain = run()
    assert np.array_equal(run(true_cfg_scale=4.0), plain)  # no negative prompt: no second pass
    assert np.abs(run(true_cfg_scale=4.0, negative_prompt="blurry") - plain).max() > 0.01


def test_latent_output_is_packed_as_diffusers(pipes, references):
    latents = flux_packed_latents(1, 64, 96, seed=2)
    request = dict(prompt="a photo of a cat", height=64, width=96, num_inference_steps=2, max_sequence_length=16)
    ref = references("dev")(latents=torch.from_numpy(latents), output_type="latent", **request).images.numpy()
    ours = pipes["dev"](latents=latents, output_type="latent", **request)
    assert ours.shape == ref.shape == (1, 24, 64)
    assert np.abs(ours - ref).max() <= 1e-4


@pytest.mark.parametrize("config", ["dev", "schnell"])
@pytest.mark.parametrize("steps", [1, 4, 28])
@pytest.mark.parametrize("tokens", [16, 1024, 4096])
def test_flux_sigmas_are_diffusers(config, steps, tokens):
    """FluxPipeline's schedule: sigmas 1 to 1/steps, shifted by mu from the token count (dev), exactly."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    from export.registry import FLUX_SCHNELL_TINY, FLUX_TINY
    from runners.schedulers.flow_match import FlowMatchEulerDiscrete

    config = (FLUX_TINY if config == "dev" else FLUX_SCHNELL_TINY)["scheduler"]
    sigmas = np.linspace(1.0, 1 / steps, steps)
    reference = FlowMatchEulerDiscreteScheduler(**config)
    reference.set_timesteps(sigmas=sigmas, mu=calculate_shift(tokens, *(config[k] for k in (
        "base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift"))))
    timesteps, ours = FlowMatchEulerDiscrete(config).timesteps(steps, FlowMatchEulerDiscrete(config).mu_for(tokens),
                                                               sigmas=sigmas)
    assert np.array_equal(ours, reference.sigmas.numpy()) and np.array_equal(timesteps, reference.timesteps.numpy())


def test_variant_and_defaults_come_from_the_transformer(pipes, builds):
    """dev's transformer takes `guidance`, schnell's has no such input; the defaults follow."""
    for variant, build in builds.items():
        inputs = [t["name"] for t in manifest(build.folder / "onnx")["submodules"]["transformer"]["inputs"]]
        assert inputs == ["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids",
                          "txt_ids", *(["guidance"] if variant == "dev" else [])]
        assert pipes[variant].variant == variant
    assert pipes["dev"].defaults["text to image"] == (28, 3.5, None)
    assert pipes["schnell"].defaults["text to image"] == (4, 0.0, None)


def test_export_checks_every_graph_at_two_shapes(builds):
    m = manifest(builds["dev"].folder / "onnx")
    assert sorted(m["submodules"]) == ["text_encoder", "text_encoder_2", "transformer", "transformer_first_block",
                                       "vae_decoder", "vae_encoder"]
    for name, sub in m["submodules"].items():
        parity = sub["export"]["parity"]
        assert len(parity) == 2 and parity[0]["dims"] != parity[1]["dims"], name
        print(name, [f"{p['max_abs_err']:.1e}" for p in parity])
    tokens = [p["dims"]["image_tokens"] for p in m["submodules"]["transformer"]["export"]["parity"]]
    assert tokens == [64, 20]  # 128x128, then 64x80 (non-square)
    assert m["dims"]["image_tokens"] == [16, 64, 1024]


@pytest.mark.parametrize("pipeline_class", ["FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline",
                                            "FluxFillPipeline", "FluxControlPipeline", "FluxKontextPipeline"])
def test_a_local_folder_of_a_flux_pipeline_is_flux(tmp_path, pipeline_class):
    import json

    from export.source import resolve

    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": pipeline_class}))
    assert resolve(str(tmp_path)).entry.family == "flux"


def test_the_conditioned_models_options_are_refused(pipes):
    """FLUX.1 Canny/Depth's control image and Kontext's size options (tests/test_flux_conditioned.py)."""
    with pytest.raises(ValueError, match="control_image= is for a FLUX.1 Canny/Depth artifact"):
        pipes["dev"]("a cat", control_image=smooth_image(64, 64), height=64, width=64)
    with pytest.raises(ValueError, match="control_noise= is the control image's VAE sample: pass control_image="):
        pipes["dev"]("a cat", control_noise=np.zeros((1, 16, 8, 8), np.float32), height=64, width=64)
    with pytest.raises(ValueError, match="max_area= and auto_resize= are FLUX.1 Kontext's"):
        pipes["dev"]("a cat", max_area=64 * 64)


def test_batched_serving_calls_equal_each_call_alone(pipes):
    """Serving's batched run (one Pipeline call for requests of one batch key) draws each request's latents in the
    loop's shape from its seed and hands them over as FluxPipeline's `latents=` takes them, packed (the layout,
    runners/latents/): each image is the one its request gets alone, up to the kernels' batch-dependent rounding."""
    from runners.serving.requests import run

    settings = {"height": 64, "width": 64, "num_inference_steps": 2}
    calls = [{"prompt": "a photo of a cat", "seed": 3, **settings}, {"prompt": "a red bus", "seed": 4, **settings}]
    assert pipes["dev"].layout.patch == 2  # the export's patch_size, bound at load
    together = run(pipes["dev"], calls)
    alone = [run(pipes["dev"], [call])[0] for call in calls]
    worst = max(int(np.abs(t.astype(int) - a).max()) for t, a in zip(together, alone))
    assert worst <= 1, f"batched images differ from single ones by {worst}/255"
    assert np.abs(alone[0].astype(int) - alone[1]).max() > 16  # two requests, two images


def test_packed_latents_of_the_wrong_shape_are_refused(pipes):
    with pytest.raises(ValueError, match=r"this request takes packed latents \(N, 16, 64\)"):
        pipes["dev"]("a cat", latents=np.zeros((1, 16, 8, 8), np.float32), height=64, width=64)
    with pytest.raises(ValueError, match="max_sequence_length=600 is not allowed: use an integer from 1 to 512"):
        pipes["dev"]("a cat", max_sequence_length=600)


IMAGE_CASES = {  # name: (build, diffusers pipeline, request)
    "image_to_image": ("dev", "FluxImg2ImgPipeline", dict(strength=0.6, height=128, width=128)),
    "image_to_image_schnell_non_square_two": ("schnell", "FluxImg2ImgPipeline",
                                              dict(strength=0.7, height=64, width=96, num_images_per_prompt=2)),
    "inpainting": ("dev", "FluxInpaintPipeline", dict(strength=0.8, height=128, width=128)),
    "inpainting_strength_1_true_cfg": ("schnell", "FluxInpaintPipeline",
                                       dict(strength=1.0, height=64, width=64, negative_prompt="blurry",
                                            true_cfg_scale=3.0)),
}


@pytest.mark.parametrize("case", IMAGE_CASES)
def test_image_tasks_match_diffusers(monkeypatch, pipes, references, case):
    variant, name, request = IMAGE_CASES[case]
    compare_flux_image_task(monkeypatch, pipes[variant], references(variant, name), case, request)


def test_cli_writes_an_image(builds, tmp_path):
    out = tmp_path / "flux.png"
    run = subprocess.run([sys.executable, "-m", "runners", str(builds["schnell"].folder / "ort-fp32"), "--prompt",
                          "a photo of a cat", "--height", "64", "--width", "64", "--out", str(out)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    from PIL import Image

    assert Image.open(out).size == (64, 64)


def test_non_finite_engine_outputs_are_an_error_not_a_black_image(pipes, monkeypatch):
    """An fp16 overflow past the calibrated ranges (or any engine's NaN) stops the run, naming the engine."""
    session = pipes["schnell"].sessions["transformer"]
    real = session.run
    monkeypatch.setattr(session, "run", lambda feeds, release=False: {
        name: np.full_like(value, np.inf) for name, value in real(feeds, release).items()})
    with pytest.raises(FloatingPointError, match=r"^transformer returned non-finite values in noise_pred.* \(fp32 "
                                                 r"artifact\): run an fp32 or OpenVINO bf16 artifact"):
        pipes["schnell"]("a cat", height=64, width=64, num_inference_steps=1)


def test_true_cfg_scale_on_the_command_line(builds, tmp_path, tiny_artifact):
    """--true-cfg-scale is Flux's, with --negative-prompt; another family's artifact refuses it in one line."""
    run = [sys.executable, "-m", "runners", "--prompt", "a photo of a cat", "--height", "64", "--width", "64",
           "--steps", "1", "--true-cfg-scale", "3"]
    done = subprocess.run(run + [str(builds["dev"].folder / "ort-fp32"), "--negative-prompt", "blurry", "--out",
                                 str(tmp_path / "flux.png")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    refused = subprocess.run(run + [str(tiny_artifact), "--out", str(tmp_path / "sd3.png")], capture_output=True,
                             text=True)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "--true-cfg-scale is flux, qwen_image, qwen_image21 and qwen_image_edit's (classifier-free guidance with a " \
           "negative prompt, as diffusers' true_cfg_scale (default 1" in refused.stderr
    assert "; this artifact is sd3's" in refused.stderr


def test_keep_scopes_keep_the_final_projection_not_the_blocks(builds):
    """Flux's transformer keeps its embedders and final layers in float; its final proj_out is named by
    its path, as every single-stream block has a proj_out too."""
    import onnx

    from engines.passes.ort_tools import nodes_in_scopes

    export = manifest(builds["dev"].folder / "onnx")["submodules"]["transformer"]
    proto = onnx.load(builds["dev"].folder / "onnx" / export["file"], load_external_data=False)
    kept = set(nodes_in_scopes(proto, export["quantization"]["keep_scopes"], ["MatMul"]))
    scopes = {n.name: next(p.value for p in n.metadata_props if p.key == "pkg.torch.onnx.name_scopes")
              for n in proto.graph.node if n.name in kept}
    assert len(kept) == 3 and sum("'transformer.proj_out'" in s for s in scopes.values()) == 1
    assert not any("single_transformer_blocks" in s for s in scopes.values())


def test_static_builds_are_refused_for_flux(builds):
    pytest.importorskip("tensorrt_rtx")
    from engines.plan import plan
    from engines.targets import TargetError
    from runners.static import StaticRequest

    from conftest import rtx_options

    with pytest.raises(TargetError, match=r"^--static is not supported for Flux: its transformer's image token count "
                                          r"and T5 length follow each request"):
        plan(builds["dev"].folder, "trt-rtx", "fp16", options=rtx_options(static=StaticRequest()))


def test_the_vae_graphs_are_flux_tinys(z_image_tiny_build, flux_tiny_build):
    """Z-Image's VAE is FLUX.1's, described by the same code in both families: whichever of the two exports comes
    second links the other's graphs rather than tracing them again (the submodule's key names the code that wraps
    it, not the family). Kept with flux-tiny's tests: z-image-tiny's, first in a suite run, have built it by
    then."""
    for name in ("vae_decoder", "vae_encoder"):
        ours, flux = ((b.folder / "onnx" / f"{name}.onnx").stat().st_ino for b in (z_image_tiny_build, flux_tiny_build))
        assert ours == flux, name
