"""Qwen-Image-Edit (export/families/qwen_image_edit.py, runners/families/qwen_image_edit/) against diffusers'
QwenImageEditPipeline and QwenImageEditPlusPipeline on qwen-image-edit-tiny and -plus-tiny (one export: the plus
folder's graphs are the same weights', linked; qwen-image-tiny's transformer and VAE graphs likewise).

Two things are set on diffusers' side, both said where they are: the input images' VAE area is the tiny entry's
(192 x 192 pixels, for the suite's time, where the pipelines' is 1024 x 1024; the code path is the same), and the
text encoder gets the processor's mm_token_type_ids, which the pipelines drop with transformers 5 (diffusers
#14194, fix open in #14189): without them Qwen2.5-VL numbers the image's tokens as text and the prompt's states
change (test_diffusers_loses_the_image_positions shows by how much)."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from conftest import qwen_packed_noise as packed_noise

# Measured: at most 2e-6 (images in [0, 1]) over the cases below; 1/255 is 3.9e-3.
IMAGE_ATOL = 5e-5
AREA = 192 * 192  # qwen-image-edit-tiny's input-image area (its registry entry's extra["image_area"])


def input_image(width: int, height: int, seed: int):
    from conftest import smooth_image

    return smooth_image(height, width, seed=seed)


def _with_image_positions(text_encoder) -> None:
    """The processor's mm_token_type_ids passed on, as diffusers #14189 does (from the input ids, which is what
    the processor computes them from)."""
    forward = text_encoder.forward

    def with_types(*args, input_ids=None, **kwargs):
        kwargs.setdefault("mm_token_type_ids", (input_ids == text_encoder.config.image_token_id).int())
        return forward(*args, input_ids=input_ids, **kwargs)
    text_encoder.forward = with_types


def _reference(build, pipeline_class: str, monkeypatch):
    import diffusers

    from export.families.qwen_image_edit import diffusers_at_area, load_processor
    from runners import Pipeline

    for patch in diffusers_at_area(AREA):
        monkeypatch.setattr(*patch)
    reference = getattr(diffusers, pipeline_class).from_pretrained(build.source.folder,
                                                                   processor=load_processor(build.source.folder))
    reference.set_progress_bar_config(disable=True)
    _with_image_positions(reference.text_encoder)
    return Pipeline.load(build.folder / "ort-fp32"), reference


@pytest.fixture(scope="module")
def monkeymodule():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def pair(qwen_image_edit_tiny_build, monkeymodule):
    return _reference(qwen_image_edit_tiny_build, "QwenImageEditPipeline", monkeymodule)


@pytest.fixture(scope="module")
def run_both(pair):
    ours, reference = pair
    cache = {}

    def run(prompt="make the sky red", image=(200, 150, 1), height=64, width=64, steps=2, per_prompt=1, **options):
        key = repr((prompt, image, height, width, steps, per_prompt, sorted(options.items())))
        if key not in cache:
            latents = packed_noise(per_prompt, height, width)
            common = dict(image=input_image(*image), height=height, width=width, num_inference_steps=steps,
                          output_type="np", num_images_per_prompt=per_prompt)
            with torch.no_grad():
                theirs = reference(prompt=prompt, latents=torch.from_numpy(latents), **common, **options).images
            cache[key] = (ours(prompt, latents=latents, **common, **options), theirs)
        return cache[key]
    return run


CFG = dict(negative_prompt="blurry", true_cfg_scale=4.0)
CASES = {  # name: (arguments, the case whose image it must change)
    "edit": (dict(), None),
    "another image": (dict(image=(150, 200, 2)), "edit"),
    "another instruction": (dict(prompt="add a small boat"), "edit"),
    "true cfg": (dict(**CFG), "edit"),
    "non-square, two per prompt": (dict(width=128, per_prompt=2, **CFG), None),
}


@pytest.mark.parametrize("case", CASES)
def test_edit_equal_to_diffusers(run_both, case):
    from conftest import assert_case_equal

    # each input changes the image by 0.0013 to 0.0037 (measured): far beyond the parity bound
    assert_case_equal(run_both, CASES, case, IMAGE_ATOL, "qwen-image-edit", 20 * IMAGE_ATOL)


def test_inpainting_equal_to_diffusers(pair, monkeypatch):
    """QwenImageEditInpaintPipeline on the Edit artifact, with true CFG: the image is the reference and inpainting's
    image, at its own size; diffusers' noise and VAE sample are ours, in the shapes it draws them (its randn_tensor
    patched). Measured: 7.7e-7. The mask matters: a white mask (the whole image inpainted) changes the edit."""
    import diffusers
    import diffusers.models.autoencoders.vae as diffusers_vae
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_inpaint as edit_inpaint

    from conftest import assert_real_image, soft_mask

    ours, edit = pair  # diffusers at the tiny model's area (`_reference`)
    reference = diffusers.QwenImageEditInpaintPipeline(**edit.components)
    reference.set_progress_bar_config(disable=True)
    image = input_image(200, 150, 1)  # 224 x 160 at the tiny model's area
    rng = np.random.default_rng(5)
    encoder_noise, noise = (rng.standard_normal(shape, dtype=np.float32)
                            for shape in ((1, 16, 1, 20, 28), (1, 1, 16, 20, 28)))
    monkeypatch.setattr(diffusers_vae, "randn_tensor", lambda shape, **kw: torch.from_numpy(encoder_noise))
    monkeypatch.setattr(edit_inpaint, "randn_tensor", lambda shape, **kw: torch.from_numpy(noise))
    request = dict(prompt="make the sky red", image=image, mask_image=soft_mask(150, 200), strength=0.6,
                   num_inference_steps=4, output_type="np", **CFG)
    with torch.no_grad():
        theirs = reference(**request).images
    got = ours(noise=noise, encoder_noise=encoder_noise, **request)
    assert got.shape == theirs.shape == (1, 160, 224, 3)
    assert_real_image(theirs)
    print(f"qwen-image-edit inpainting: |ours - diffusers| {np.abs(got - theirs).max():.1e}")
    assert np.abs(got - theirs).max() <= IMAGE_ATOL
    from PIL import Image

    whole = ours(noise=noise, encoder_noise=encoder_noise, **{**request, "mask_image": Image.new("L", (200, 150), 255)})
    assert np.abs(got - whole).max() > 0.01  # the mask kept part of the image
    with pytest.raises(ValueError, match="QwenImageEditInpaintPipeline paints at the image's size"):
        ours(height=64, **request)
    with pytest.raises(ValueError, match="strength: inpainting's"):
        ours("make it red", image=image, strength=0.5, num_inference_steps=1)


def test_diffusers_loses_the_image_positions(pair, qwen_image_edit_tiny_build):
    """What diffusers #14194 costs: its text encoder without mm_token_type_ids gives other prompt states."""
    _, reference = pair
    image = reference.image_processor.resize(input_image(200, 150, 1), 144, 192)
    with torch.no_grad():
        kept, _ = reference.encode_prompt("make the sky red", image=image, device="cpu")
        reference.text_encoder.forward = type(reference.text_encoder).forward.__get__(reference.text_encoder)
        try:
            lost, _ = reference.encode_prompt("make the sky red", image=image, device="cpu")
        finally:
            _with_image_positions(reference.text_encoder)
    print(f"qwen-image-edit: states without the image positions differ by {float((kept - lost).abs().max()):.3f}")
    assert float((kept - lost).abs().max()) > 1e-3


def test_image_processor_equal_to_qwen2vl_processor(qwen_image_edit_tiny_build):
    """runners/families/qwen_image_edit/vision.py against Qwen2VLProcessor's image processor (PIL backend) on 5
    sizes: pixel values and grids exactly."""
    from conftest import assert_processor_patches_equal

    assert_processor_patches_equal(qwen_image_edit_tiny_build.source.folder, "Qwen2VLProcessor", 14,
                                   [(1024, 1024), (97, 61), (333, 500), (1240, 832), (30, 40)])


@pytest.fixture(scope="module")
def plus_pair(qwen_image_edit_plus_tiny_build, monkeymodule):
    return _reference(qwen_image_edit_plus_tiny_build, "QwenImageEditPlusPipeline", monkeymodule)


PLUS_CALL = dict(prompt="put the cat on the sofa", height=64, width=96, num_inference_steps=2, output_type="np", **CFG)


def _plus_images():
    return [input_image(200, 150, 1), input_image(120, 160, 2)]


@pytest.fixture(scope="module")
def plus_images(plus_pair):
    """diffusers' and our QwenImageEditPlusPipeline with two input images of different sizes and guidance."""
    ours, reference = plus_pair
    latents = packed_noise(1, 64, 96)
    with torch.no_grad():
        theirs = reference(image=_plus_images(), latents=torch.from_numpy(latents), **PLUS_CALL).images
    return ours(image=_plus_images(), latents=latents, **PLUS_CALL), theirs


def test_edit_plus_with_two_images_equal_to_diffusers(plus_pair, plus_images):
    """QwenImageEditPlusPipeline (Qwen-Image-Edit-2509) with two input images; the second changes the result."""
    from conftest import assert_real_image

    got, theirs = plus_images
    assert_real_image(theirs)
    print(f"qwen-image-edit-plus two images: |ours - diffusers| {np.abs(got - theirs).max():.1e}")
    assert np.abs(got - theirs).max() <= IMAGE_ATOL
    one = plus_pair[0](image=_plus_images()[:1], latents=packed_noise(1, 64, 96), **PLUS_CALL)
    assert np.abs(got - one).max() > 20 * IMAGE_ATOL


def test_edit_2511_equal_to_diffusers(qwen_image_edit_2511_tiny_build, monkeypatch, plus_images):
    """Qwen-Image-Edit-2511's transformer (zero_cond_t: the input images' tokens modulated at timestep 0) as
    QwenImageEditPlusPipeline runs it, two input images; the modulation changes 2509's image (same weights)."""
    ours, reference = _reference(qwen_image_edit_2511_tiny_build, "QwenImageEditPlusPipeline", monkeypatch)
    latents = packed_noise(1, 64, 96)
    with torch.no_grad():
        theirs = reference(image=_plus_images(), latents=torch.from_numpy(latents), **PLUS_CALL).images
    got = ours(image=_plus_images(), latents=latents, **PLUS_CALL)
    print(f"qwen-image-edit-2511 two images: |ours - diffusers| {np.abs(got - theirs).max():.1e}, "
          f"2509's image changed by {np.abs(got - plus_images[0]).max():.4f}")
    assert np.abs(got - theirs).max() <= IMAGE_ATOL
    assert np.abs(got - plus_images[0]).max() > 10 * IMAGE_ATOL  # measured 0.0008: 1000 times the parity error


def test_export_parity_and_graphs(qwen_image_edit_tiny_build):
    """Each graph against its PyTorch module at two shapes (the vision tower at 3 and 2 windows); the transformer
    and VAE graphs are qwen-image-tiny's (same weights: linked, not exported again)."""
    from conftest import manifest

    subs = manifest(qwen_image_edit_tiny_build.folder / "onnx")["submodules"]
    assert set(subs) == {"image_encoder", "text_encoder", "transformer", "transformer_first_block", "vae_decoder",
                         "vae_encoder"}
    for name, sub in subs.items():
        checks = sub["export"]["parity"]
        assert len({tuple(c["dims"].items()) for c in checks}) >= 2, name
        for check in checks:
            assert check["max_abs_err"] <= 1e-5 * max(1.0, check["max_abs_ref"]), (name, check)
    assert {c["dims"]["vision_windows"] for c in subs["image_encoder"]["export"]["parity"]} == {3, 2}


def test_refusals(pair):
    ours, _ = pair
    call = dict(height=64, width=64, num_inference_steps=1, output_type="np")
    with pytest.raises(ValueError, match="image= is required"):
        ours("make it red", **call)
    with pytest.raises(ValueError, match="QwenImageEditPipeline takes one"):
        ours("make it red", image=[input_image(64, 64, 1)] * 2, **call)
    with pytest.raises(ValueError, match="more than this artifact's 1024"):
        ours("word " * 1000, image=input_image(64, 64, 1), **call)


# Image PSNR against ort-fp32 (no guidance; true CFG), measured by the test below on an EPYC with AVX512-BF16 and
# VNNI: ort fp16 76.5, 76.8 dB; openvino int8 44.7, 45.0. Bounds 5 dB under, OpenVINO's allowing for AMX as
# test_qwen_image.py's do (see there).
TARGET_MIN_PSNR = {"fp16": (71.5, 71.5), "openvino-int8": (31.0, 31.0)}


def _target_images(artifact):
    from runners import Pipeline

    pipe = Pipeline.load(artifact)
    latents = packed_noise(1, 64, 64, seed=1)
    return [pipe("make the sky red", image=input_image(200, 150, 1), latents=latents, height=64, width=64,
                 num_inference_steps=3, output_type="np", **options) for options in ({}, CFG)]


def test_targets_within_their_bounds(qwen_image_edit_tiny_build):
    from conftest import assert_targets_within

    assert_targets_within(qwen_image_edit_tiny_build.folder, _target_images, TARGET_MIN_PSNR, "qwen-image-edit")


def test_lora_in_lightnings_names_equal_to_diffusers(qwen_image_edit_tiny_build, qwen_image_tiny_build, tmp_path,
                                                     monkeypatch):
    """An adapter of the transformer in Qwen-Image-Edit-Lightning's names (the module paths, lora_down/up, alpha)
    at load, against diffusers' QwenImageEditPipeline.load_lora_weights + fuse_lora; switched off, the plain image.
    (Made on qwen-image-tiny's pipeline, whose transformer the Edit one is.)"""
    from diffusers import QwenImagePipeline
    from lora_adapters import make_adapter
    from test_qwen_image import LORA_TARGETS, _trainer_named

    from runners import Pipeline

    peft = make_adapter(QwenImagePipeline, qwen_image_tiny_build.source.folder, tmp_path / "a", LORA_TARGETS,
                        seed=5, rank=2, alpha=4.0)
    adapter = _trainer_named(peft, tmp_path / "lightning.safetensors", "")
    plain, reference = _reference(qwen_image_edit_tiny_build, "QwenImageEditPipeline", monkeypatch)
    reference.load_lora_weights(adapter, adapter_name="a")
    reference.fuse_lora(adapter_names=["a"])
    latents = packed_noise(1, 64, 64, seed=5)
    call = dict(prompt="make the sky red", image=input_image(200, 150, 1), height=64, width=64, num_inference_steps=2,
                output_type="np")
    with torch.no_grad():
        theirs = reference(latents=torch.from_numpy(latents), **call).images
    loaded = Pipeline.load(qwen_image_edit_tiny_build.folder / "ort-fp32", loras={adapter: 1.0})
    got = loaded(latents=latents, **call)
    print(f"qwen-image-edit LoRA (Lightning's names): |ours - diffusers| {np.abs(got - theirs).max():.1e}")
    assert np.abs(got - theirs).max() <= IMAGE_ATOL
    loaded.set_loras({})
    without = loaded(latents=latents, **call)
    assert np.array_equal(without, plain(latents=latents, **call))
    print(f"qwen-image-edit LoRA: changed the image by {np.abs(theirs - without).max():.3f}")
    assert np.abs(theirs - without).max() > 0.05


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None, reason="tensorrt-rtx is not installed")
def test_tensorrt_rtx_builds_every_submodule(qwen_image_edit_tiny_build, monkeypatch):
    """Real TensorRT-RTX engines of every graph (the vision tower's windows and the language model's 3D positions
    as profile axes); through the GPU stand-in, ONNX Runtime's images exactly."""
    from conftest import assert_rtx_builds_every_submodule

    assert_rtx_builds_every_submodule(qwen_image_edit_tiny_build.folder, _target_images, monkeypatch)
