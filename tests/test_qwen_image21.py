"""Qwen-Image 2.1 (export/families/qwen_image21.py, runners/families/qwen_image21/) against diffusers'
QwenImage21Pipeline on qwen-image-2.1-tiny: text to image with its KV cache (diffusers' default), true CFG, several
prompts and images, Turbo's sigmas. One export and one ort-fp32 build."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from conftest import two_prompt_images

# Measured: at most 1.3e-6 (images in [0, 1]) over the cases below; 1/255 is 3.9e-3.
IMAGE_ATOL = 5e-5
# Qwen-Image-2.1-Turbo's model_index.json sample_sigmas (8 steps)
TURBO_SIGMAS = [1.0, 0.978453, 0.95418, 0.926626, 0.89508, 0.845148, 0.704534, 0.414568]


def packed_noise(n: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """Latents as QwenImage21Pipeline takes them: (n, tokens, 16), a token a latent pixel (16 x 16 image pixels)."""
    return np.random.default_rng(seed).standard_normal((n, (height // 16) * (width // 16), 16), dtype=np.float32)


def _reference(folder):
    """diffusers' pipeline of the folder, given its processor (transformers loads Qwen3VLProcessor only with its
    video processor, which needs torchvision)."""
    from diffusers import QwenImage21Pipeline

    from export.families.qwen_image_edit import load_processor

    reference = QwenImage21Pipeline.from_pretrained(folder, processor=load_processor(folder, "Qwen3VLProcessor"))
    reference.set_progress_bar_config(disable=True)
    return reference


@pytest.fixture(scope="module")
def pair(qwen_image_2_1_tiny_build):
    from runners import Pipeline

    build = qwen_image_2_1_tiny_build
    return Pipeline.load(build.folder / "ort-fp32"), _reference(build.source.folder)


@pytest.fixture(scope="module")
def run_both(pair):
    from conftest import paired_runs

    return paired_runs(pair, packed_noise)


def _references():
    """Reference images: an RGBA one whose alpha ramps across it, and an RGB one of another aspect ratio."""
    from PIL import Image

    rng = np.random.default_rng(7)
    rgba = rng.integers(0, 256, (150, 200, 4), dtype=np.uint8)
    rgba[..., 3] = np.linspace(0, 255, 200).astype(np.uint8)[None]
    return Image.fromarray(rgba, "RGBA"), Image.fromarray(rng.integers(0, 256, (160, 120, 3), dtype=np.uint8))


RGBA_REFERENCE, RGB_REFERENCE = _references()
REFERENCE = dict(output_resolution=128)  # the references at about 128 x 128 pixels: 16 image tokens each
CFG = dict(negative_prompt="blurry, dark", true_cfg_scale=4.0)
CASES = {  # name: (arguments, the case whose image it must change)
    "no guidance": (dict(prompt="a red cat"), None),
    "true cfg": (dict(prompt="a red cat", **CFG), "no guidance"),
    "another prompt": (dict(prompt="a lighthouse on a cliff at dusk"), "no guidance"),
    # one negative prompt a prompt: diffusers does not repeat a single one for several prompts (it fails)
    "two lengths, two each, cfg": (dict(prompt=["a red cat", "a golden dragon on the moon at sunset, misty light"],
                                        negative_prompt=["blurry", "dark and noisy"], true_cfg_scale=4.0,
                                        per_prompt=2), None),
    "non-square": (dict(prompt="a red cat", width=128), None),
    "empty prompt": (dict(prompt=""), "no guidance"),
    "empty negative prompt": (dict(prompt="a red cat", negative_prompt="", true_cfg_scale=4.0), "true cfg"),
    "turbo sigmas": (dict(prompt="a red cat", sigmas=TURBO_SIGMAS, steps=8), "no guidance"),
    "a reference": (dict(prompt="a red cat", image=[RGBA_REFERENCE], **REFERENCE), "no guidance"),
    "a reference, cfg": (dict(prompt="a red cat", image=[RGBA_REFERENCE], **CFG, **REFERENCE), "a reference"),
    "two references": (dict(prompt="a red cat", image=[RGBA_REFERENCE, RGB_REFERENCE], **REFERENCE), "a reference"),
    "two references, two lengths, two each, cfg, non-square": (
        dict(prompt=["a red cat", "a golden dragon on the moon at sunset, misty light"], image=[RGB_REFERENCE,
             RGBA_REFERENCE], negative_prompt=["blurry", "dark and noisy"], true_cfg_scale=4.0, per_prompt=2,
             width=96, **REFERENCE), None),
}


@pytest.mark.parametrize("case", CASES)
def test_equal_to_diffusers(run_both, case):
    from conftest import assert_case_equal

    # a feature changes the tiny model's image by 0.0015 (the prompt) to 0.027 (Turbo's sigmas), measured: its
    # random text path moves the image less than a level of 255 (0.004), still 1000 times the parity error
    assert_case_equal(run_both, CASES, case, IMAGE_ATOL, "qwen-image-2.1", 1e-3)


def test_a_folders_sample_sigmas_are_the_default(pair, qwen_image_2_1_tiny_build, monkeypatch):
    """A folder whose model_index.json sets sample_sigmas (Qwen-Image-2.1-Turbo's) runs them when sigmas= is not
    given, as diffusers does: the export records them, and the runner reads them."""
    import json
    import types

    from export.families.qwen_image21 import runtime_constants

    ours, reference = pair
    folder = qwen_image_2_1_tiny_build.source.folder
    index = {**json.loads((folder / "model_index.json").read_text()), "sample_sigmas": TURBO_SIGMAS}
    source = qwen_image_2_1_tiny_build.source
    assert runtime_constants(types.SimpleNamespace(config=source.config, entry=source.entry, folder=folder,
                                                   model_index=lambda: index))["sample_sigmas"] == TURBO_SIGMAS
    monkeypatch.setitem(ours.constants, "sample_sigmas", TURBO_SIGMAS)
    latents = packed_noise(1, 64, 64, seed=2)
    call = dict(prompt="a red cat", height=64, width=64, output_type="np")
    reference.register_to_config(sample_sigmas=TURBO_SIGMAS)  # the pipeline's own, as from_pretrained sets it
    try:
        with torch.no_grad():
            theirs = reference(latents=torch.from_numpy(latents), **call).images
    finally:
        reference.register_to_config(sample_sigmas=None)
    got = ours(latents=latents, **call)
    assert np.abs(got - theirs).max() <= IMAGE_ATOL
    monkeypatch.setitem(ours.constants, "sample_sigmas", None)
    assert np.abs(got - ours(latents=latents, num_inference_steps=8, **call)).max() > 1e-3  # not linspace's 8


def test_rgba_images_and_packed_latents(run_both, pair):
    """The images are RGBA as diffusers' (PIL mode too); output_type="latent" gives its packed latents."""
    ours, reference = pair
    image = ours("a red cat", height=64, width=128, num_inference_steps=2, latents=packed_noise(1, 64, 128))[0]
    assert image.mode == "RGBA" and image.size == (128, 64)
    latents = packed_noise(1, 64, 128, seed=4)
    call = dict(prompt="a red cat", height=64, width=128, num_inference_steps=3)
    with torch.no_grad():
        theirs = reference(latents=torch.from_numpy(latents), output_type="latent", **call).images.numpy()
    got = ours(latents=latents, output_type="latent", **call)
    assert got.shape == theirs.shape == (1, 32, 16)
    assert np.abs(got - theirs).max() <= 1e-4


def test_reference_size_and_bad_references(pair):
    """The size left unset is the last reference's at about output_resolution² pixels (diffusers' too); references
    the artifact cannot take are refused in one line."""
    ours, reference = pair
    call = dict(prompt="a red cat", image=[RGB_REFERENCE, RGBA_REFERENCE], num_inference_steps=2, output_type="np",
                **REFERENCE)
    with torch.no_grad():
        theirs = reference(**call).images
    assert ours(**call).shape == theirs.shape == (1, 96, 160, 4)  # 200 x 150 at 128², multiples of 32
    for image, words in (([RGB_REFERENCE] * 4, "4 reference images: this artifact takes up to 3"),
                         ([[RGB_REFERENCE]], "image= is one flat list of reference images for every prompt"),
                         (["a cat"], "image= takes PIL images or uint8 arrays")):
        with pytest.raises(ValueError, match=words):
            ours("a red cat", image=image, height=64, width=64, **REFERENCE)
    with pytest.raises(ValueError, match=r"a reference sized to 1184x896 pixels \(output_resolution=1024\) is outside "
                                         r"what this artifact's vision tower takes \(up to 80 patches"):
        ours("a red cat", image=[RGBA_REFERENCE], height=64, width=64, output_resolution=1024)
    # the tiny model's default: its references' size (the pipeline's 1024 for Qwen-Image 2.1)
    assert ours("a red cat", image=[RGB_REFERENCE], num_inference_steps=2, output_type="np").shape == (1, 160, 96, 4)


def test_vision_positions_equal_transformers():
    """runners/families/qwen_image21/vision.py against transformers' Qwen3-VL helpers: each patch's taps into the
    learned position grid, their weights and its rotary position, exactly, for grids of both sizes' sides."""
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

    from runners.families.qwen_image21.vision import patch_positions

    for side in (8, 48):
        for rows, cols in [(2, 2), (4, 4), (6, 10), (52, 80), (96, 34)]:
            grid = torch.tensor([[1, rows, cols]])
            indices, weights = get_vision_interpolation_indices_and_weights(
                grid, num_grid_per_side=side, mode="bilinear", align_corners=True, spatial_merge_size=2)
            ours = patch_positions(rows, cols, side, 2)
            assert np.array_equal(ours.indices, indices.numpy()) and np.array_equal(ours.weights, weights.numpy())
            assert np.array_equal(ours.positions, get_vision_position_ids(grid, 2).numpy()), (side, rows, cols)


def test_image_processor_equal_to_qwen3vl_processor(qwen_image_2_1_tiny_build):
    """The Edit runner's image path (runners/families/qwen_image_edit/vision.py) with Qwen3-VL's patches of 16 and
    the folder's normalisation ([-1, 1], as Qwen3-VL's) against the folder's image processor on 5 sizes: pixel
    values and grids exactly."""
    import json

    from conftest import assert_processor_patches_equal

    folder = qwen_image_2_1_tiny_build.source.folder
    assert json.loads((folder / "processor" / "preprocessor_config.json").read_text())["image_mean"] == [0.5] * 3
    assert_processor_patches_equal(folder, "Qwen3VLProcessor", 16,
                                   [(160, 96), (97, 61), (333, 500), (1240, 832), (30, 40)])


def test_export_parity_and_the_prefix_graph(qwen_image_2_1_tiny_build):
    """Each graph against its PyTorch module at two shapes (the step graph at two image sizes, with one graph);
    the prefix graph returns every block's keys and values and the step graph reads them."""
    from conftest import manifest

    subs = manifest(qwen_image_2_1_tiny_build.folder / "onnx")["submodules"]
    assert sorted(subs) == ["image_encoder", "text_encoder", "transformer", "transformer_prefix", "vae_decoder",
                            "vae_encoder"]
    for name, sub in subs.items():
        checks = sub["export"]["parity"]
        assert len({tuple(c["dims"].items()) for c in checks}) >= 2, name
        for check in checks:
            assert check["max_abs_err"] <= 1e-5 * max(1.0, check["max_abs_ref"]), (name, check)
    assert [t["name"] for t in subs["transformer_prefix"]["outputs"]] == ["prefix_keys", "prefix_values"]
    assert {"prefix_keys", "prefix_values"} <= {t["name"] for t in subs["transformer"]["inputs"]}
    assert subs["text_encoder"]["export"]["graph"]["layers_kept"] == 2  # the last layer, before the final norm


# Every kind of linear layer in the transformer: both graphs' (the prefix's and the step's), the modulation's too
LORA_TARGETS = {"transformer": ["to_q", "to_k", "to_v", "to_out.0", "img_mlp.proj", "img_mlp.out", "txt_in.in_layer",
                                "modulation.1", "img_in", "proj_out"]}


def test_lora_equal_to_diffusers_fuse_lora(pair, qwen_image_2_1_tiny_build, tmp_path):
    """An adapter on every kind of the transformer's linear layers (so on both its graphs) against diffusers'
    load_lora_weights + fuse_lora of the same file, with true CFG; switched off, the plain image exactly. (Measured:
    the modulation's adapter was lost while the prefix graph's timestep was a constant that folded its weights.)"""
    from diffusers import QwenImage21Pipeline

    from export.families.qwen_image_edit import load_processor
    from lora_adapters import make_adapter
    from runners import Pipeline

    folder = qwen_image_2_1_tiny_build.source.folder
    adapter = make_adapter(QwenImage21Pipeline, folder, tmp_path / "a", LORA_TARGETS, seed=5, rank=2, alpha=4.0,
                           processor=load_processor(folder, "Qwen3VLProcessor"))
    reference = _reference(folder)
    reference.load_lora_weights(adapter, adapter_name="a")
    reference.set_adapters(["a"], [0.8])
    reference.fuse_lora(adapter_names=["a"])
    call = dict(prompt="a red cat", height=64, width=64, num_inference_steps=3, output_type="np", **CFG,
                image=[RGBA_REFERENCE], **REFERENCE)  # the prefix reads the reference's latents (img_in) too
    latents = packed_noise(1, 64, 64, seed=5)
    with torch.no_grad():
        theirs = reference(latents=torch.from_numpy(latents), **call).images
    loaded = Pipeline.load(qwen_image_2_1_tiny_build.folder / "ort-fp32", loras={adapter: 0.8})
    got = loaded(latents=latents, **call)
    print(f"qwen-image-2.1 LoRA: max abs error {np.abs(got - theirs).max():.1e}")
    assert np.abs(got - theirs).max() <= IMAGE_ATOL
    loaded.set_loras({})
    plain = loaded(latents=latents, **call)
    assert np.abs(theirs - plain).max() > 0.05  # the adapter changes the image
    assert np.array_equal(plain, pair[0](latents=latents, **call))


def test_refusals_and_warnings(pair, caplog):
    ours, _ = pair
    call = dict(height=64, width=64, num_inference_steps=2, output_type="np")
    with caplog.at_level("WARNING", logger="runners"):
        ours("a cat", true_cfg_scale=3.0, latents=packed_noise(1, 64, 64), **call)
        ours("a cat", negative_prompt="blurry", latents=packed_noise(1, 64, 64), **call)
    assert "true_cfg_scale=3.0 does nothing without a negative_prompt" in caplog.text
    assert "negative_prompt does nothing with true_cfg_scale <= 1" in caplog.text
    with pytest.raises(ValueError, match=r"latents have shape \(1, 4, 16\); this request takes packed latents "
                                         r"\(N, 16, 16\)"):
        ours("a cat", latents=np.zeros((1, 4, 16), np.float32), **call)
    with pytest.raises(ValueError, match="height=48 is not allowed: use a multiple of 32"):
        ours("a cat", **{**call, "height": 48})
    with pytest.raises(ValueError, match="sigmas=.* is not allowed"):
        ours("a cat", sigmas=[1.5, 0.5], **call)
    with pytest.raises(ValueError, match="the prompt takes more than this artifact's 256 tokens"):
        ours("a cat " * 300, **call)


# Image PSNR against ort-fp32 per call (no guidance; true CFG with a reference), measured by the test below on a Xeon
# with AMX (calibrated on 4 prompts x 4 steps, every other call with a reference): ort fp16 77.5, 76.4 dB; openvino
# bf16 57.4, 56.8, int8 37.5, 37.5 (45.4 and 44.9 without the reference on an EPYC with AVX512-BF16 and VNNI;
# 44.8 and 45.2 on a Zen 3 without VNNI, 27.3 there before int8's weights took 7 bits: docs/openvino.md). Bounds
# 5 dB under fp16's; OpenVINO's are Qwen-Image's (CI's AMX loses about 19 dB more on bf16: see
# tests/test_qwen_image.py). The suite runs these three for its time; the other precisions' passes are the other
# families' tests'.
TARGET_MIN_PSNR = {"fp16": (72.5, 71.4), "openvino-bf16": (31.5, 31.0), "openvino-int8": (31.0, 31.0)}


_target_images = two_prompt_images(packed_noise, {**CFG, "image": [RGBA_REFERENCE], **REFERENCE})


def test_every_target_and_precision_within_its_bound(qwen_image_2_1_tiny_build):
    from conftest import assert_targets_within

    assert_targets_within(qwen_image_2_1_tiny_build.folder, _target_images, TARGET_MIN_PSNR, "qwen-image-2.1")


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None, reason="tensorrt-rtx is not installed")
def test_tensorrt_rtx_builds_every_submodule(qwen_image_2_1_tiny_build, monkeypatch):
    """Real fp16 engines for every submodule; the pipeline on them through the GPU stand-in gives ONNX Runtime's
    images exactly."""
    from conftest import assert_rtx_builds_every_submodule

    assert_rtx_builds_every_submodule(qwen_image_2_1_tiny_build.folder, _target_images, monkeypatch)
