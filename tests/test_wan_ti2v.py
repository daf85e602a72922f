"""Wan 2.2 TI2V-5B (export/families/wan.py with model_index.json's expand_timesteps, runners/families/wan/) against
diffusers' WanPipeline and WanImageToVideoPipeline on wan22-ti2v-tiny: a timestep per token, 48-channel latents at
16 x 16 pixels, text to video and image to video (the image's latent as the first frame, at timestep 0); its
patchifying VAE's chunk graphs against AutoencoderKLWan. One export (the text encoder linked from wan-tiny's) and one
ort-fp32 build."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

# Measured: at most 4.6e-6 (frames in [0, 1]) over the cases below; 1/255 is 3.9e-3.
FRAMES_ATOL = 5e-5
CHANNELS, SCALE = 48, 16


def _latents(n: int, frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    shape = (n, CHANNELS, (frames - 1) // 4 + 1, height // SCALE, width // SCALE)
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


@pytest.fixture(scope="module")
def pair(wan22_ti2v_tiny_build):
    from diffusers import WanImageToVideoPipeline, WanPipeline

    from conftest import with_wan_prompt_cleaning
    from runners import Pipeline

    with_wan_prompt_cleaning()
    reference = WanPipeline.from_pretrained(wan22_ti2v_tiny_build.source.folder)
    reference.set_progress_bar_config(disable=True)
    assert reference.config.expand_timesteps
    to_video = WanImageToVideoPipeline(**reference.components, expand_timesteps=True)
    to_video.set_progress_bar_config(disable=True)
    return Pipeline.load(wan22_ti2v_tiny_build.folder / "ort-fp32"), reference, to_video


def _image(seed: int, height: int = 64, width: int = 64):
    from conftest import smooth_image

    return smooth_image(height, width, seed)


@pytest.fixture(scope="module")
def run_both(pair):
    """run(prompt, frames=9, height=64, width=64, steps=3, image=None, **options) -> (ours, diffusers') frames
    (N, F, H, W, 3) from the same latents; each request runs once."""
    ours, reference, to_video = pair
    cache = {}

    def run(prompt, frames=9, height=64, width=64, steps=3, image=None, **options):
        key = repr((prompt, frames, height, width, steps, image, sorted(options.items())))
        if key not in cache:
            n = len(prompt) if isinstance(prompt, list) else 1
            latents = _latents(n, frames, height, width)
            common = dict(prompt=prompt, height=height, width=width, num_frames=frames, num_inference_steps=steps,
                          **options)
            images = {} if image is None else {"image": _image(image, height, width)}
            with torch.no_grad():
                theirs = (to_video if image else reference)(latents=torch.from_numpy(latents), output_type="np",
                                                            **images, **common).frames
            cache[key] = ours(latents=latents, **images, **common), theirs
        return cache[key]
    return run


CASES = {  # name: (arguments, the case whose frames it must change)
    "text to video": (dict(prompt="a red cat walking"), None),
    "no guidance": (dict(prompt="a red cat walking", guidance_scale=1.0), "text to video"),
    "non-square, 17 frames": (dict(prompt="a red cat walking", width=96, frames=17), None),
    "image to video": (dict(prompt="a red cat walking", image=1), "text to video"),
    "another image": (dict(prompt="a red cat walking", image=2), "image to video"),
    "two prompts, image to video": (dict(prompt=["a red cat walking", "waves on a beach at dusk"], image=1), None),
}


@pytest.mark.parametrize("case", CASES)
def test_equal_to_diffusers(run_both, case):
    from conftest import assert_case_equal

    assert_case_equal(run_both, CASES, case, FRAMES_ATOL, "wan ti2v", 1e-3)


def test_image_to_video_keeps_the_image_frame_at_timestep_0(pair):
    """The transformer's timesteps per token: t on every token of text to video; 0 on the first latent frame's
    tokens (2 x 2 of a 64 x 64 clip) with an image, t on the others."""
    ours = pair[0]
    seen = []
    ours.recorder = lambda submodule, feeds: seen.append(feeds["timestep"].copy()) \
        if submodule == "transformer" else None
    try:
        for image in (None, _image(1)):
            seen.clear()
            ours("a cat", image=image, num_frames=9, height=64, width=64, num_inference_steps=1, guidance_scale=1.0,
                 output_type="latent")
            (timestep,) = seen
            assert timestep.shape == (1, 3 * 2 * 2)
            assert (timestep[:, 4:] > 0).all()
            assert ((timestep[:, :4] == 0) if image else (timestep[:, :4] == timestep[:, 4:5])).all()
    finally:
        ours.recorder = None


def test_chunked_decoder_and_encoder_equal_autoencoder(pair):
    """Wan 2.2's VAE (residual blocks on 2 x 2 patches): the decoder's chunk graphs decode 9 and 17 frames and the
    encoder's give their posterior, as AutoencoderKLWan does (one pair of graphs for any count)."""
    ours, reference, _ = pair
    vae = reference.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    for frames in (9, 17):
        latents = _latents(1, frames, 64, 96, seed=frames)
        with torch.no_grad():
            theirs = vae.decode(torch.from_numpy(latents) / (1.0 / std) + mean, return_dict=False)[0]
        theirs = (theirs / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).numpy()
        decoded = ours.decode_video(latents)
        assert decoded.shape == theirs.shape == (1, frames, 64, 96, 3)
        video = np.random.default_rng(frames).uniform(-1, 1, (1, 3, frames, 64, 96)).astype(np.float32)
        with torch.no_grad():
            posterior = vae.encode(torch.from_numpy(video)).latent_dist
        encoded = ours.encode_video(video)
        assert encoded[0].shape == (1, CHANNELS, 1 + (frames - 1) // 4, 4, 6)
        errors = [float(np.abs(decoded - theirs).max()),
                  *(float(np.abs(a - b.numpy()).max()) for a, b in
                    zip(encoded, ((posterior.mean - mean) * (1.0 / std), posterior.logvar + 2 * torch.log(1.0 / std))))]
        print(f"wan 2.2 vae {frames} frames: |ours - diffusers| decoded {errors[0]:.1e}, latent mean {errors[1]:.1e}, "
              f"logvar {errors[2]:.1e}")
        assert errors[0] <= FRAMES_ATOL and max(errors[1:]) <= 1e-5


def test_image_to_video_is_refused_on_text_to_video_wan(wan_tiny_build):
    from runners import Pipeline

    pipe = Pipeline.load(wan_tiny_build.folder / "ort-fp32")
    with pytest.raises(ValueError, match="image to video is Wan 2.2 TI2V-5B's"):
        pipe("a cat", image=_image(1), num_inference_steps=1, output_type="latent")


# wan22-ti2v-tiny at the call below: 8 steps of 10 cached (0.08: 4, but changing the frames by 7e-4 only)
@pytest.mark.parametrize("threshold", (0.1,))
def test_first_block_cache_with_an_image_equal_to_diffusers_hooks(pair, threshold):
    """First-Block Cache on image to video (its first-block graph takes the timesteps per token) against diffusers'
    `apply_first_block_cache` on WanImageToVideoPipeline: the same decisions, frames within FRAMES_ATOL, changed."""
    from conftest import first_block_cache_against_diffusers

    ours, _, to_video = pair
    call = dict(prompt="a red cat walking", image=_image(1), height=64, width=64, num_frames=9,
                num_inference_steps=10, negative_prompt="blurry", output_type="np")
    error, changed = first_block_cache_against_diffusers((ours, to_video), threshold, _latents(1, 9, 64, 64, seed=2),
                                                         "wan ti2v", contexts=("cond", "uncond"), **call)
    assert error <= FRAMES_ATOL and changed > 1e-3


def _target_videos(artifact):
    """An artifact's two 64x64, 9-frame videos of 4 steps from fixed latents: text to video, and image to video."""
    from runners import Pipeline

    pipe = Pipeline.load(artifact)
    latents = _latents(1, 9, 64, 64, seed=1)
    return [pipe("a photo of a cat", latents=latents, height=64, width=64, num_frames=9, num_inference_steps=4,
                 **options) for options in ({}, {"image": _image(3)})]


# Frames' PSNR against ort-fp32 per video (text, then image to video), measured by this test (an AMD EPYC without
# AMX): fp16 74.2, 73.2 dB; OpenVINO int8 30.2, 36.3 (the VAE decoder's activations int8 too; 46.8, 48.7 with
# int8 weights only there). Bounds 5 dB under each; OpenVINO's also lose the 19 dB CI's AMX lost on bf16
# (tests/test_wan.py). Wan 2.1's test holds the other targets: this one the graphs TI2V changes (a
# timestep per token, the patchifying VAE) under fp16 and under calibration on text and image to video clips.
TARGET_MIN_PSNR = {"fp16": (69.0, 68.0), "openvino-int8": (6.0, 12.0)}


def test_every_target_and_precision_within_its_bound(wan22_ti2v_tiny_build):
    """fp16 and OpenVINO int8 (calibrated on text and image to video clips) within their bounds."""
    from conftest import assert_targets_within

    assert_targets_within(wan22_ti2v_tiny_build.folder, _target_videos, TARGET_MIN_PSNR, "wan ti2v")


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None, reason="tensorrt-rtx is not installed")
def test_tensorrt_rtx_builds_every_submodule(wan22_ti2v_tiny_build, monkeypatch):
    """Real fp16 engines for every submodule (the timesteps per token, the patchifying VAE's chunk graphs); the
    pipeline on them through the GPU stand-in gives ONNX Runtime's videos exactly."""
    from conftest import assert_rtx_builds_every_submodule

    assert_rtx_builds_every_submodule(wan22_ti2v_tiny_build.folder, _target_videos, monkeypatch)
