"""LTX-Video (export/families/ltx.py, runners/families/ltx/) against diffusers' LTXPipeline and
LTXImageToVideoPipeline on ltx-video-tiny: 9 and 17 frames, guidance on and off, a negative prompt, non-square
frames, several prompts, the decode timestep and its noise, a frame rate, image to video; the VAE's decoder and
encoder against AutoencoderKLLTXVideo. One export and one ort-fp32 build."""
from __future__ import annotations

import numpy as np
import pytest
import torch

# Measured: at most 2.4e-6 (frames in [0, 1]) over the cases below; 1/255 is 3.9e-3.
FRAMES_ATOL = 5e-5
CHANNELS = 128


def _shape(n: int, frames: int, height: int, width: int) -> tuple:
    return n, CHANNELS, (frames - 1) // 8 + 1, height // 32, width // 32


@pytest.fixture(scope="module")
def pair(ltx_video_tiny_build):
    from diffusers import LTXImageToVideoPipeline, LTXPipeline

    from runners import Pipeline

    reference = LTXPipeline.from_pretrained(ltx_video_tiny_build.source.folder)
    reference.set_progress_bar_config(disable=True)
    to_video = LTXImageToVideoPipeline(**reference.components)
    to_video.set_progress_bar_config(disable=True)
    return Pipeline.load(ltx_video_tiny_build.folder / "ort-fp32"), reference, to_video


@pytest.fixture(scope="module")
def run_both(pair):
    """run(prompt, frames=9, height=64, width=64, steps=3, **options) -> (ours, diffusers') frames (N, F, H, W, 3)
    from the same noise: diffusers' generator draws (the image's posterior sample, the latents, the decode noise),
    given to ours; each request runs once."""
    from runners.families.ltx import pack

    ours, reference, to_video = pair
    cache = {}

    def run(prompt, frames=9, height=64, width=64, steps=3, image=None, **options):
        key = repr((prompt, frames, height, width, steps, image is not None, sorted(options.items())))
        if key not in cache:
            n = len(prompt) if isinstance(prompt, list) else 1
            shape = _shape(n, frames, height, width)
            common = dict(prompt=prompt, height=height, width=width, num_frames=frames, num_inference_steps=steps,
                          output_type="np", **options)
            generator = torch.Generator().manual_seed(0)
            with torch.no_grad():
                if image is None:  # latents given: the decode noise is the generator's first draw
                    latents = pack(np.random.default_rng(1).standard_normal(shape, dtype=np.float32))
                    theirs = reference(latents=torch.from_numpy(latents), generator=generator, **common).frames
                    mine = ours(latents=latents, **common,
                                decode_noise=torch.randn(shape, generator=torch.Generator().manual_seed(0)).numpy())
                else:  # the image's posterior sample, the starting noise, the decode noise
                    theirs = to_video(image=image, generator=generator, **common).frames
                    draws = torch.Generator().manual_seed(0)
                    encoder_noise = torch.randn((1, CHANNELS, 1, *shape[3:]), generator=draws).numpy()
                    noise, decode_noise = (torch.randn(shape, generator=draws).numpy() for _ in range(2))
                    mine = ours(image=image, encoder_noise=encoder_noise, noise=noise, decode_noise=decode_noise,
                                **common)
            cache[key] = mine, theirs
        return cache[key]
    return run


def _image(height: int = 64, width: int = 64):
    from conftest import smooth_image

    return smooth_image(height, width)


CASES = {  # name: (arguments, the case whose frames it must change)
    "9 frames": (dict(prompt="a red cat walking"), None),
    "no guidance": (dict(prompt="a red cat walking", guidance_scale=1.0), "9 frames"),
    "negative prompt": (dict(prompt="a red cat walking", negative_prompt="blurry, static"), "9 frames"),
    "17 frames": (dict(prompt="a red cat walking", frames=17), None),
    "non-square": (dict(prompt="a red cat walking", width=96), None),
    "two prompts": (dict(prompt=["a red cat walking", "waves on a beach at dusk, slow motion"]), None),
    "decode timestep": (dict(prompt="a red cat walking", decode_timestep=0.05), "9 frames"),
    "frame rate": (dict(prompt="a red cat walking", frame_rate=12.0), "9 frames"),
    "image to video": (dict(prompt="a red cat walking", image="smooth"), None),
}


@pytest.mark.parametrize("case", CASES)
def test_equal_to_diffusers(run_both, case):
    from conftest import assert_case_equal

    def run(image=None, **arguments):
        return run_both(image=_image() if image else None, **arguments)

    assert_case_equal(run, CASES, case, FRAMES_ATOL, "ltx", 1e-3)
