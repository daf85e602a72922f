"""The tiny autoencoder (export --tiny-vae): decode and encode parity with diffusers' AutoencoderTiny,
the pipeline with vae="tiny" against diffusers' with `pipe.vae = AutoencoderTiny(...)`, and live
previews through the tiny decoder."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import TINY_VAE, assert_real_image, manifest, smooth_image, with_tiny_vae
from runners import Pipeline

ONE_LEVEL = 1 / 255
# openvino-int8 with the tiny VAE against ort-fp32 with it, sd3-tiny 64x64 (measured 50.2-50.8 dB with VNNI, 53.4 on
# a Zen 3 with 7-bit weights)
MIN_INT8_PSNR = 45.0


@pytest.fixture(scope="module")
def tiny_autoencoder():
    from diffusers import AutoencoderTiny

    from export.families.tiny_vae import COMPONENT, tiny_vae_source

    return AutoencoderTiny.from_pretrained(tiny_vae_source(TINY_VAE, 16).folder / COMPONENT).eval()


@pytest.fixture(scope="module")
def tiny_pipe(sd3_tiny_vae_build):
    with Pipeline.load(sd3_tiny_vae_build.folder / "ort-fp32", vae="tiny") as pipe:
        yield pipe


def test_manifest_and_engines(sd3_tiny_vae_build, tiny_pipe):
    manifest = tiny_pipe.manifest
    assert {"vae_decoder_tiny", "vae_encoder_tiny"} <= set(manifest["submodules"])
    assert manifest["pipeline"]["tiny_vae"] == {"scaling_factor": 1.5305, "shift_factor": 0.0609, "source": TINY_VAE}
    assert "vae_decoder" not in tiny_pipe.sessions and "vae_decoder_tiny" in tiny_pipe.sessions


def test_decode_and_encode_match_diffusers(tiny_pipe, tiny_autoencoder):
    z = np.random.default_rng(0).standard_normal((2, 16, 10, 12), dtype=np.float32)
    with torch.no_grad():
        ref = tiny_autoencoder.decode(torch.from_numpy(z)).sample.numpy()
    ours = tiny_pipe.vae_decode(z)
    assert np.abs(ours - ref).max() / 2 <= ONE_LEVEL  # images in [-1, 1]: half the range is one unit
    image = np.clip(ref, -1, 1)
    with torch.no_grad():
        ref_latents = tiny_autoencoder.encode(torch.from_numpy(image)).latents.numpy()
    (latents,) = tiny_pipe.vae_encode(image)
    assert np.abs(latents - ref_latents).max() <= 1e-4 * max(1.0, np.abs(ref_latents).max())


def test_pipeline_with_tiny_vae_matches_diffusers(tiny_pipe, reference_pipeline, tiny_autoencoder):
    kwargs = dict(prompt="a photo of a cat", height=64, width=96, num_inference_steps=4, max_sequence_length=32,
                  output_type="np")
    latents = np.random.default_rng(1).standard_normal((1, 16, 8, 12), dtype=np.float32)
    full_vae = reference_pipeline.vae
    reference_pipeline.vae = tiny_autoencoder  # diffusers' recipe; its scaling and shift come with it
    try:
        ref = reference_pipeline(latents=torch.from_numpy(latents), **kwargs).images
    finally:
        reference_pipeline.vae = full_vae
    ours = tiny_pipe(latents=latents, **kwargs)
    print(f"text to image with the tiny VAE: |ours - diffusers| {np.abs(ours - ref).max():.2e}")
    assert np.abs(ours - ref).max() <= ONE_LEVEL
    assert_real_image(ref)


def test_image_to_image_encodes_with_the_tiny_encoder(tiny_pipe, tiny_autoencoder):
    """The tiny encoder's latents are taken as they are (no posterior sample), scaled with its factors."""
    image = smooth_image(64, 64)
    pixels = np.asarray(image, dtype=np.float32).transpose(2, 0, 1)[None] / 127.5 - 1
    with torch.no_grad():
        expected = tiny_autoencoder.encode(torch.from_numpy(pixels)).latents.numpy()
    expected = (expected - np.float32(0.0609)) * np.float32(1.5305)
    got = tiny_pipe._image_latents(pixels, 1, encoder_noise=None, vae_tiling=None)
    assert np.abs(got - expected).max() <= 1e-4 * max(1.0, np.abs(expected).max())


def test_previews_through_the_tiny_decoder(sd3_tiny_vae_build):
    """The full VAE decodes the image; the previews come from the tiny decoder, and cost their time."""
    with Pipeline.load(sd3_tiny_vae_build.folder / "ort-fp32") as pipe:
        call = dict(prompt="a cat", height=64, width=64, num_inference_steps=4, seed=0, output_type="np")
        plain = pipe(**call)
        seen = []
        previewed = pipe(**call, preview_every=2, on_preview=lambda step, images: seen.append((step, images)))
        assert [step for step, _ in seen] == [2, 4]
        assert all(len(images) == 1 and images[0].size == (64, 64) for _, images in seen)
        assert np.array_equal(plain, previewed) and pipe.timings["previews"] > 0
        # the last preview is the tiny decoder's image of the final latents (flow matching's x0 at the last
        # step is the last Euler step's result)
        final = pipe(**{**call, "output_type": "latent"})
        expected = pipe.run("vae_decoder_tiny", latent=final / np.float32(1.5305) + np.float32(0.0609))["image"]
        last = np.asarray(seen[-1][1][0], dtype=np.float32) / 255
        assert np.abs(last - np.clip(expected[0].transpose(1, 2, 0) / 2 + 0.5, 0, 1)).max() <= 1.5 * ONE_LEVEL


def test_tiny_vae_refusals(tiny_artifact):
    from export.families.tiny_vae import tiny_vae_source
    from export.source import SourceError

    with pytest.raises(ValueError, match="has no tiny autoencoder"):
        Pipeline.load(tiny_artifact, vae="tiny")
    with pytest.raises(ValueError, match="vae='small' is not allowed"):
        Pipeline.load(tiny_artifact, vae="small")
    with pytest.raises(SourceError, match="4 latent channels; this model's latents have 16"):
        tiny_vae_source("taesd-tiny", 16)


# The other families' random tiny autoencoders, and their starting latents at 64x128 (Flux's packed;
# sd15-tiny's U-Net takes sides in multiples of 64).
FAMILY_TINY = {"sd15": ("taesd-tiny", (1, 4, 8, 16)), "sdxl": ("taesdxl-tiny", (1, 4, 8, 16)),
               "flux": ("taef1-tiny", (1, 32, 64))}


@pytest.mark.parametrize("family", FAMILY_TINY)
def test_each_familys_tiny_vae_matches_diffusers(family, request):
    """Decode parity with AutoencoderTiny, and the pipeline with vae="tiny" against diffusers' with
    `pipe.vae = AutoencoderTiny(...)`, on SD1.5, SDXL and Flux; the tiny VAE must change the image."""
    import diffusers
    from diffusers import AutoencoderTiny

    from export.families.tiny_vae import COMPONENT, tiny_vae_source

    tiny, shape = FAMILY_TINY[family]
    build = with_tiny_vae(request.getfixturevalue(f"{family}_tiny_build"), tiny)
    channels = manifest(build.folder / "onnx")["constants"]["latent_channels"]
    autoencoder = AutoencoderTiny.from_pretrained(tiny_vae_source(tiny, channels).folder / COMPONENT).eval()
    reference = diffusers.DiffusionPipeline.from_pretrained(build.source.folder)
    reference.set_progress_bar_config(disable=True)
    reference.vae = autoencoder
    call = dict(prompt="a photo of a cat", height=64, width=128, num_inference_steps=4, output_type="np")
    latents = np.random.default_rng(2).standard_normal(shape, dtype=np.float32)
    ref = reference(latents=torch.from_numpy(latents), **call).images
    with Pipeline.load(build.folder / "ort-fp32", vae="tiny") as pipe:
        z = np.random.default_rng(0).standard_normal((2, channels, 10, 12), dtype=np.float32)
        with torch.no_grad():
            decoded = autoencoder.decode(torch.from_numpy(z)).sample.numpy()
        assert np.abs(pipe.vae_decode(z) - decoded).max() / 2 <= ONE_LEVEL
        ours = pipe(latents=latents, **call)
    with Pipeline.load(build.folder / "ort-fp32") as pipe:
        full_vae = pipe(latents=latents, **call)
    error, changed = float(np.abs(ours - ref).max()), float(np.abs(ours - full_vae).max())
    print(f"{family} with {tiny}: |ours - diffusers| {error:.2e}; the tiny VAE changed the image by {changed:.2f}")
    assert error <= ONE_LEVEL and changed > 10 * ONE_LEVEL
    assert_real_image(ref)


def test_an_int8_build_calibrates_the_tiny_autoencoder(sd3_tiny_vae_build, tiny_pipe):
    """The pipeline calls the VAE or the tiny autoencoder, never both: the calibration feeds the tiny one what
    the VAE is fed (latents in its own scaling), so that an int8 build of an export with one measures it
    (before, the build stopped: "recorded no calls of vae_decoder_tiny")."""
    from engines.api import build_artifact
    from engines.calibration import CalibrationFeeds, CalibrationSettings, collect

    settings = CalibrationSettings(prompts=4, steps=2)  # few calls: this test's time
    artifact = build_artifact(sd3_tiny_vae_build.folder, "openvino", "int8", calibration=settings)
    recorded = collect(sd3_tiny_vae_build.folder / "ort-fp32", settings)  # the build's, up to date
    full, tiny = (CalibrationFeeds(recorded, name) for name in ("vae_decoder", "vae_decoder_tiny"))
    assert len(tiny) == len(full) > 0 and len(CalibrationFeeds(recorded, "vae_encoder_tiny")) > 0
    (scaling, shift), (tiny_scaling, tiny_shift) = tiny_pipe.vae_factors("full"), tiny_pipe.vae_factors("tiny")
    expected = (full[0]["latent"] - np.float32(shift)) * np.float32(scaling) / np.float32(tiny_scaling) \
        + np.float32(tiny_shift)
    assert np.allclose(tiny[0]["latent"], expected, rtol=1e-6, atol=1e-6)
    call = dict(prompt="a cat", height=64, width=64, num_inference_steps=4, seed=0, output_type="np")
    with Pipeline.load(artifact, vae="tiny") as pipe:
        image = pipe(**call)
    psnr = 10 * np.log10(1 / np.mean((image - tiny_pipe(**call)) ** 2))
    print(f"openvino-int8 with the tiny VAE against ort-fp32's: {psnr:.1f} dB")
    assert MIN_INT8_PSNR <= psnr < 80  # close to fp32's, and quantized
