"""LTX-Video (export/families/ltx.py, runners/families/ltx/) against diffusers' LTXPipeline and
LTXImageToVideoPipeline on ltx-video-tiny: 9 and 17 frames, guidance on and off, a negative prompt, non-square
frames, several prompts, the decode timestep and its noise, a frame rate, image to video; the VAE's decoder and
encoder against AutoencoderKLLTXVideo. One export and one ort-fp32 build."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

# Measured: at most 2.4e-6 (frames in [0, 1]) over the cases below; 1/255 is 3.9e-3.
FRAMES_ATOL = 5e-5
CHANNELS = 128


def pack(latents: np.ndarray) -> np.ndarray:
    """A clip's latents as LTXPipeline takes them (its layout's packing: runners/latents/)."""
    from runners.families.ltx import LTXPipeline

    return LTXPipeline.layout.pack(latents)


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
    ours, reference, to_video = pair
    cache = {}

    def run(prompt, frames=9, height=64, width=64, steps=3, image=None, **options):
        key = repr((prompt, frames, height, width, steps, image and np.asarray(image).sum(), sorted(options.items())))
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


def _image(seed: int, height: int = 64, width: int = 64):
    from conftest import smooth_image

    return smooth_image(height, width, seed)


CASES = {  # name: (arguments, the case whose frames it must change)
    "9 frames": (dict(prompt="a red cat walking"), None),
    "no guidance": (dict(prompt="a red cat walking", guidance_scale=1.0), "9 frames"),
    "negative prompt": (dict(prompt="a red cat walking", negative_prompt="blurry, static"), "9 frames"),
    "17 frames": (dict(prompt="a red cat walking", frames=17), None),
    "non-square": (dict(prompt="a red cat walking", width=96), None),
    "two prompts": (dict(prompt=["a red cat walking", "waves on a beach at dusk, slow motion"]), None),
    "decode timestep": (dict(prompt="a red cat walking", decode_timestep=0.05), "9 frames"),
    "frame rate": (dict(prompt="a red cat walking", frame_rate=12.0), "9 frames"),
    "image to video": (dict(prompt="a red cat walking", image=1), None),
    "another image": (dict(prompt="a red cat walking", image=2), "image to video"),
}


@pytest.mark.parametrize("case", CASES)
def test_equal_to_diffusers(run_both, case):
    from conftest import assert_case_equal

    def run(image=None, **arguments):
        return run_both(image=image and _image(image), **arguments)

    assert_case_equal(run, CASES, case, FRAMES_ATOL, "ltx", 1e-3)


def test_decoder_and_encoder_equal_autoencoder(pair):
    """The decoder graph decodes 9 and 17 frames (2 and 3 latent frames: one graph for any count) at a decode
    timestep as AutoencoderKLLTXVideo decodes them; the encoder graph's posterior of an image is its one-frame
    clip's."""
    ours, reference, _ = pair
    vae = reference.vae
    for latent_frames in (2, 3):
        latents = np.random.default_rng(latent_frames).standard_normal((1, CHANNELS, latent_frames, 2, 3), np.float32)
        timestep = np.full(1, 0.05, np.float32)
        with torch.no_grad():
            theirs = vae.decode(torch.from_numpy(latents), torch.from_numpy(timestep), return_dict=False)[0]
        theirs = (theirs / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).numpy()
        frames = ours.run("vae_decoder", latent=latents, timestep=timestep)["frames"]
        frames = np.clip(frames / 2 + 0.5, 0, 1).transpose(0, 2, 3, 4, 1)
        assert frames.shape == theirs.shape == (1, 1 + 8 * (latent_frames - 1), 64, 96, 3)
        error = float(np.abs(frames - theirs).max())
        print(f"ltx vae decoder {frames.shape[1]} frames: |ours - diffusers| {error:.1e}")
        assert error <= FRAMES_ATOL
    image = np.asarray(_image(3), np.float32).transpose(2, 0, 1)[None] / 127.5 - 1
    with torch.no_grad():
        posterior = vae.encode(torch.from_numpy(image)[:, :, None]).latent_dist
    out = ours.run("vae_encoder", image=image)
    for name, theirs in (("latent_mean", posterior.mean), ("latent_logvar", posterior.logvar)):
        error = float(np.abs(out[name] - theirs[:, :, 0].numpy()).max())
        print(f"ltx vae encoder {name}: |ours - diffusers| {error:.1e}")
        assert error <= 1e-5


def test_latent_output_is_diffusers(pair):
    """output_type="latent" gives the packed latents (N, tokens, 128), as LTXPipeline returns them."""
    ours, reference, _ = pair
    latents = pack(np.random.default_rng(4).standard_normal(_shape(1, 9, 64, 64), dtype=np.float32))
    call = dict(prompt="a red cat walking", height=64, width=64, num_frames=9, num_inference_steps=2)
    with torch.no_grad():
        theirs = reference(latents=torch.from_numpy(latents), output_type="latent", **call).frames.numpy()
    mine = ours(latents=latents, output_type="latent", **call)
    assert mine.shape == theirs.shape == (1, 2 * 2 * 2, CHANNELS)
    assert float(np.abs(mine - theirs).max()) <= 1e-4


def test_several_videos_each_read_their_own_prompt(pair):
    """Two prompts, two videos each: each video is its prompt's alone (diffusers pairs the states p0, p0, p1, p1 with
    the masks m0, m1, m0, m1, and its decode crashes: its decode timestep is per prompt)."""
    ours, _, _ = pair
    prompts = ["a red cat walking", "waves on a beach at dusk, slow motion, golden light"]
    noise = np.random.default_rng(5).standard_normal(_shape(4, 9, 64, 64), dtype=np.float32)
    decode_noise = np.random.default_rng(6).standard_normal(noise.shape, dtype=np.float32)
    call = dict(height=64, width=64, num_frames=9, num_inference_steps=2, decode_timestep=0.05)
    together = ours(prompts, num_videos_per_prompt=2, latents=pack(noise), decode_noise=decode_noise, **call)
    for i in range(4):
        alone = ours(prompts[i // 2], latents=pack(noise[i:i + 1]), decode_noise=decode_noise[i:i + 1], **call)
        assert float(np.abs(together[i] - alone[0]).max()) <= 1e-5, i


def test_bad_requests_are_refused_before_any_engine_runs(pair, caplog):
    ours, _, _ = pair
    common = dict(num_inference_steps=2, output_type="latent")
    for options, said in ((dict(num_frames=0), "num_frames=0 is not allowed"),
                          (dict(num_frames=33), r"num_frames=33 is outside this artifact's range 9\.\.25"),
                          (dict(height=80), "height=80 is not allowed"),
                          (dict(max_sequence_length=200), "max_sequence_length=200 is outside"),
                          (dict(decode_timestep=1.5), r"decode_timestep=1\.5 is not allowed"),
                          (dict(image=[_image(1), _image(2)]), "2 images for 1 prompts"),
                          (dict(num_inference_steps=1), "num_inference_steps=1 cannot be stretched")):
        with pytest.raises(ValueError, match=said):
            ours("a cat", **{**common, **options})
    with caplog.at_level("WARNING", logger="runners"):
        latents = ours("a cat", num_frames=12, height=64, width=64, **common)
    assert latents.shape == (1, 2 * 2 * 2, CHANNELS) and "12 frames rounded to 9" in caplog.text


def test_a_noise_injecting_decoder_is_refused_at_export():
    """LTX-Video 0.9.1's decoder draws noise from torch's global state inside its blocks: no graph can be equal."""
    from diffusers import AutoencoderKLLTXVideo

    from export.families.ltx import _Decoder
    from export.registry import LTX_TINY

    with torch.device("meta"):
        vae = AutoencoderKLLTXVideo(**{**LTX_TINY["vae"], "decoder_inject_noise": [True, True, True, False]})
    with pytest.raises(ValueError, match="decoder_inject_noise"):
        _Decoder(vae)


def test_cli_writes_an_image_to_video_mp4_at_its_frame_rate(ltx_video_tiny_build, pair, tmp_path):
    """The CLI's --image starts the video from it; the mp4 runs at the request's --frame-rate."""
    from runners.__main__ import main
    from runners.video import read_mp4

    _image(1).save(tmp_path / "first.png")
    args = [str(ltx_video_tiny_build.folder / "ort-fp32"), "--prompt", "a red cat walking", "--num-frames", "9",
            "--height", "64", "--width", "64", "--steps", "2", "--seed", "0", "--frame-rate", "12",
            "--image", str(tmp_path / "first.png"), "--out", str(tmp_path / "clip.mp4")]
    assert main(args) == 0
    frames, fps = read_mp4(tmp_path / "clip.mp4")
    assert frames.shape == (9, 64, 64, 3) and fps == 12


def _target_videos(artifact):
    """An artifact's two 64x64, 9-frame videos of 4 steps: a prompt with guidance (the default 3) from fixed
    latents, and image to video with a negative prompt."""
    from runners import Pipeline
    pipe = Pipeline.load(artifact)
    noise = np.random.default_rng(1).standard_normal(_shape(1, 9, 64, 64), dtype=np.float32)
    common = dict(height=64, width=64, num_frames=9, num_inference_steps=4, decode_timestep=0.05, seed=2)
    return [pipe("a photo of a cat", latents=pack(noise), **common),
            pipe("a red fox", image=_image(1), negative_prompt="blurry", noise=noise, **common)]


# Frames' PSNR against ort-fp32 per video (text to video, image to video), measured by this test (onnxruntime 1.32,
# OpenVINO 2026.4.1, NNCF 3.4, a 2-core AMD EPYC without AMX): fp16 55.6, 59.6 dB; OpenVINO bf16 49.0, 50.2, int8
# 40.8, 42.7 (the VAE decoder's activations int8 too; 47.9, 45.7 with int8 weights only there). Bounds 5 dB under
# each; OpenVINO's also lose the 19 dB CI's AMX lost on bf16 (tests/test_wan.py).
TARGET_MIN_PSNR = {"fp16": (50.5, 54.5), "openvino-bf16": (25.0, 26.0), "openvino-int8": (16.5, 18.5)}


def test_every_target_and_precision_within_its_bound(ltx_video_tiny_build):
    """Every submodule through each target and precision, the pipeline's videos (text and image to video) within
    their bounds; calibration runs 17-frame clips through every graph."""
    from conftest import assert_targets_within

    assert_targets_within(ltx_video_tiny_build.folder, _target_videos, TARGET_MIN_PSNR, "ltx")


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None, reason="tensorrt-rtx is not installed")
def test_tensorrt_rtx_builds_every_submodule(ltx_video_tiny_build, monkeypatch):
    """Real fp16 engines for every submodule; the pipeline on them through the GPU stand-in gives ONNX Runtime's
    videos exactly."""
    from conftest import assert_rtx_builds_every_submodule

    assert_rtx_builds_every_submodule(ltx_video_tiny_build.folder, _target_videos, monkeypatch)


def _noise(seed: int) -> np.ndarray:
    return pack(np.random.default_rng(seed).standard_normal(_shape(1, 9, 64, 64), dtype=np.float32))


CACHE_CALL = dict(prompt="a red cat walking", height=64, width=64, num_frames=9, negative_prompt="blurry",
                  output_type="np")


@pytest.mark.parametrize("case", {"interval 2, order 1": dict(cache_interval=2, disable_cache_before_step=2,
                                                               max_order=1)})
def test_taylorseer_equal_to_diffusers_hook(pair, case):
    """TaylorSeer lite on the LTX transformer against diffusers' hook on its output layer (`proj_out`), guidance in
    one batch: the same steps cached, the frames within FRAMES_ATOL, and the cache changed them."""
    from conftest import diffusers_schedule, with_diffusers_taylorseer
    from runners import TaylorSeerCacheConfig

    ours, reference, _ = pair
    config = TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=2, max_order=1)
    steps, latents = 8, _noise(7)
    call = dict(CACHE_CALL, num_inference_steps=steps)
    theirs, calls = with_diffusers_taylorseer(reference, config, "proj_out", latents=torch.from_numpy(latents),
                                              generator=torch.Generator().manual_seed(0), **call)
    decode_noise = torch.randn(_shape(1, 9, 64, 64), generator=torch.Generator().manual_seed(0)).numpy()
    cached = ours(latents=latents, cache=config, decode_noise=decode_noise, **call)
    schedule = diffusers_schedule(config, steps)
    assert calls == steps and (ours.cache_stats["full"], ours.cache_stats["cached"]) == (sum(schedule),
                                                                                         schedule.count(False))
    plain = ours(latents=latents, decode_noise=decode_noise, **call)
    error, changed = float(np.abs(cached - theirs).max()), float(np.abs(cached - plain).max())
    print(f"ltx taylorseer: |ours - diffusers| {error:.1e}, the cache changed the frames by {changed:.3f}")
    assert error <= FRAMES_ATOL and changed > 1e-3


@pytest.mark.parametrize("threshold", (0.12, 0.2))
def test_first_block_cache_equal_to_diffusers_hooks(pair, threshold):
    """First-Block Cache on the LTX transformer's `transformer_blocks` against diffusers' `apply_first_block_cache`,
    guidance in one batch: the same decisions, the frames within FRAMES_ATOL, and the cache changed them."""
    from conftest import first_block_cache_against_diffusers

    ours, reference, _ = pair
    error, changed = first_block_cache_against_diffusers((ours, reference), threshold, _noise(8), "ltx",
                                                         num_inference_steps=10, decode_timestep=0.0, **CACHE_CALL)
    assert error <= FRAMES_ATOL and changed > 1e-3


# Every kind of the transformer's linear layers: both attentions', the feed-forward's, the embedders' and the output's
LORA_TARGETS = {"transformer": ["to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2", "proj_in", "proj_out",
                                "linear_1", "linear_2"]}


def test_lora_equal_to_diffusers_fuse_lora(pair, ltx_video_tiny_build, tmp_path):
    """An LTX-Video adapter on every kind of the transformer's linear layers, in diffusers' format, against diffusers'
    load_lora_weights + fuse_lora of the same file, with guidance; switched off, the plain frames exactly."""
    from diffusers import LTXPipeline

    from lora_adapters import make_adapter
    from runners import Pipeline

    folder = ltx_video_tiny_build.source.folder
    adapter = make_adapter(LTXPipeline, folder, tmp_path / "a", LORA_TARGETS, seed=5, rank=2, alpha=1.0)
    reference = LTXPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    reference.load_lora_weights(adapter, adapter_name="a")
    reference.set_adapters(["a"], [0.8])
    reference.fuse_lora(adapter_names=["a"])
    call = dict(CACHE_CALL, num_inference_steps=3)
    latents = _noise(5)
    decode_noise = torch.randn(_shape(1, 9, 64, 64), generator=torch.Generator().manual_seed(0)).numpy()
    with torch.no_grad():
        theirs = reference(latents=torch.from_numpy(latents), generator=torch.Generator().manual_seed(0), **call)[0]
    loaded = Pipeline.load(ltx_video_tiny_build.folder / "ort-fp32", loras={adapter: 0.8})
    got = loaded(latents=latents, decode_noise=decode_noise, **call)
    print(f"ltx LoRA: |ours - diffusers| {np.abs(got - theirs).max():.1e}")
    assert np.abs(got - theirs).max() <= FRAMES_ATOL
    loaded.set_loras({})
    plain = loaded(latents=latents, decode_noise=decode_noise, **call)
    assert np.abs(theirs - plain).max() > 0.05  # the adapter changes the video
    assert np.array_equal(plain, pair[0](latents=latents, decode_noise=decode_noise, **call))


def test_triton_serves_the_mp4_at_the_requests_frame_rate(ltx_video_tiny_build, pair, tmp_path):
    """The artifact served by a real tritonserver on 127.0.0.1: a request's frames are the Pipeline's (rounded as its
    PIL output, within a level), and its mp4 runs at the request's frame_rate, which the model was told."""
    tritonclient_http = pytest.importorskip("tritonclient.http")
    from runners.serving.repository import write_repository
    from runners.video import read_mp4
    from conftest import server_for

    ours = pair[0]
    call = dict(num_frames=9, height=64, width=64, num_inference_steps=2)
    expected = (ours("a red cat walking", seed=3, frame_rate=12.0, **call) * 255).round().astype(np.uint8)
    model = write_repository(ltx_video_tiny_build.folder / "ort-fp32", tmp_path / "repository")
    with server_for(tmp_path / "repository") as server:
        client = tritonclient_http.InferenceServerClient(server.http_url)
        inputs = []
        for name, value, kind in (("prompt", b"a red cat walking", "BYTES"), ("seed", 3, "INT64"),
                                  ("frame_rate", 12.0, "FP32"), *((k, v, "INT32") for k, v in call.items())):
            dtype = {"BYTES": object, "INT32": np.int32, "INT64": np.int64, "FP32": np.float32}[kind]
            tensor = tritonclient_http.InferInput(name, [1, 1], kind)
            tensor.set_data_from_numpy(np.array([[value]], dtype=dtype))
            inputs.append(tensor)
        result = client.infer(model.name, inputs, outputs=[tritonclient_http.InferRequestedOutput(n)
                                                           for n in ("frames", "mp4")])
    frames = result.as_numpy("frames")
    # measured: 1 level on 0.003% of the values (the server's session rounds a few pixels the other way)
    assert frames.shape == (1, 1, 9, 64, 64, 3) and np.abs(frames[0].astype(int) - expected).max() <= 1
    decoded, fps = read_mp4(result.as_numpy("mp4")[0, 0])
    assert decoded.shape == (9, 64, 64, 3) and fps == 12
