"""Wan 2.1 text to video (export/families/wan.py, runners/families/wan/) against diffusers' WanPipeline on
wan-tiny: 9 and 17 frames, guidance on and off, a negative prompt, non-square frames, several prompts and videos,
UniPC (the folder's) and flow-matching Euler; the chunked VAE decoder against AutoencoderKLWan. One export and one
ort-fp32 build."""
from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

# Measured: at most 5.1e-6 (frames in [0, 1]) over the cases below, the decoder alone 1.2e-6; 1/255 is 3.9e-3.
FRAMES_ATOL = 5e-5


def video_noise(n: int, frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """Latents as WanPipeline takes them: (n, 16, (frames - 1) / 4 + 1, height / 8, width / 8)."""
    shape = (n, 16, (frames - 1) // 4 + 1, height // 8, width // 8)
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


@pytest.fixture(scope="module")
def pair(wan_tiny_build):
    from diffusers import WanPipeline

    from runners import Pipeline

    reference = WanPipeline.from_pretrained(wan_tiny_build.source.folder)
    reference.set_progress_bar_config(disable=True)
    return Pipeline.load(wan_tiny_build.folder / "ort-fp32"), reference


@pytest.fixture(scope="module")
def run_both(pair):
    """run(prompt, frames=9, height=64, width=64, steps=3, per_prompt=1, **options) -> (ours, diffusers') frames,
    (N, F, H, W, 3), from the same latents; each request runs once."""
    ours, reference = pair
    cache = {}

    def run(prompt, frames=9, height=64, width=64, steps=3, per_prompt=1, euler=False, **options):
        key = repr((prompt, frames, height, width, steps, per_prompt, euler, sorted(options.items())))
        if key not in cache:
            n = (len(prompt) if isinstance(prompt, list) else 1) * per_prompt
            latents = video_noise(n, frames, height, width)
            common = dict(height=height, width=width, num_frames=frames, num_inference_steps=steps,
                          num_videos_per_prompt=per_prompt, prompt=prompt, **options)
            scheduler = reference.scheduler
            if euler:  # both on flow-matching Euler, shifted as Wan's UniPC is
                from diffusers import FlowMatchEulerDiscreteScheduler

                reference.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
                ours.set_scheduler(dict(reference.scheduler.config, _class_name="FlowMatchEulerDiscreteScheduler"))
            try:
                with torch.no_grad():
                    theirs = reference(latents=torch.from_numpy(latents), output_type="np", **common).frames
                cache[key] = (ours(latents=latents, **common), theirs)
            finally:
                reference.scheduler = scheduler
                ours.set_scheduler(dict(scheduler.config, _class_name=type(scheduler).__name__))
        return cache[key]
    return run


CASES = {  # name: (arguments, the case whose frames it must change)
    "9 frames": (dict(prompt="a red cat walking"), None),
    "no guidance": (dict(prompt="a red cat walking", guidance_scale=1.0), "9 frames"),
    "negative prompt": (dict(prompt="a red cat walking", negative_prompt="blurry, static"), "9 frames"),
    "17 frames": (dict(prompt="a red cat walking", frames=17), None),
    "non-square": (dict(prompt="a red cat walking", width=96), None),
    "two prompts, two videos each": (dict(prompt=["a red cat walking", "waves on a beach at dusk, slow motion"],
                                          per_prompt=2), None),
    "flow euler": (dict(prompt="a red cat walking", euler=True), "9 frames"),
}


@pytest.mark.parametrize("case", CASES)
def test_equal_to_diffusers(run_both, case):
    from conftest import assert_case_equal

    assert_case_equal(run_both, CASES, case, FRAMES_ATOL, "wan", 1e-3)


def test_chunked_decoder_equals_autoencoder(pair):
    """The two chunk graphs, looped over the latent frames with their cache, decode 9 and 17 frames (3 and 5
    latent frames: one pair of graphs for any count) as AutoencoderKLWan decodes the whole clip."""
    ours, reference = pair
    vae = reference.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    for latent_frames in (3, 5):
        latents = np.random.default_rng(latent_frames).standard_normal((1, 16, latent_frames, 4, 6), np.float32)
        with torch.no_grad():
            theirs = vae.decode(torch.from_numpy(latents) / (1.0 / std) + mean, return_dict=False)[0]
        theirs = (theirs / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).numpy()
        frames = ours.decode_video(latents)
        assert frames.shape == theirs.shape == (1, 1 + 4 * (latent_frames - 1), 32, 48, 3)
        error = float(np.abs(frames - theirs).max())
        print(f"wan vae {frames.shape[1]} frames: |ours - diffusers| {error:.1e}")
        assert error <= FRAMES_ATOL


def test_chunked_encoder_equals_autoencoder(pair):
    """The encoder's two chunk graphs, the first frame then 4 at a time, give AutoencoderKLWan's posterior of 9 and
    17 frames, normalised as the pipelines normalise its latents."""
    ours, reference = pair
    vae = reference.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    for frames in (9, 17):
        video = np.random.default_rng(frames).uniform(-1, 1, (1, 3, frames, 32, 48)).astype(np.float32)
        with torch.no_grad():
            posterior = vae.encode(torch.from_numpy(video)).latent_dist
        theirs = ((posterior.mean - mean) * (1.0 / std)).numpy(), (posterior.logvar + 2 * torch.log(1.0 / std)).numpy()
        latent_mean, latent_logvar = ours.encode_video(video)
        assert latent_mean.shape == theirs[0].shape == (1, 16, 1 + (frames - 1) // 4, 4, 6)
        errors = [float(np.abs(a - b).max()) for a, b in zip((latent_mean, latent_logvar), theirs)]
        print(f"wan vae encoder {frames} frames: |ours - diffusers| mean {errors[0]:.1e}, logvar {errors[1]:.1e}")
        assert max(errors) <= 1e-5  # measured 7.2e-7


def test_previews_show_the_middle_frame(pair):
    """Live previews of a video: its middle latent frame's x0 through Wan's latent-to-RGB map, at the frame's size;
    they leave the video as it was."""
    ours, _ = pair
    seen = []
    common = dict(num_frames=9, num_inference_steps=2, seed=0, height=64, width=96)
    plain = ours("a red cat walking", **common)
    previewed = ours("a red cat walking", preview_every=1, on_preview=lambda step, images: seen.append((step, images)),
                     **common)
    assert np.array_equal(plain, previewed)
    assert [step for step, _ in seen] == [1, 2] and all(len(images) == 1 for _, images in seen)
    assert seen[0][1][0].size == (96, 64)
    assert not np.array_equal(np.asarray(seen[0][1][0]), np.asarray(seen[1][1][0]))


TAYLORSEER_CASES = {"interval 2, order 1": dict(cache_interval=2, disable_cache_before_step=2, max_order=1),
                    "interval 3, order 2": dict(cache_interval=3, disable_cache_before_step=2, max_order=2)}


@pytest.mark.parametrize("case", TAYLORSEER_CASES)
def test_taylorseer_equal_to_diffusers_hook(pair, case):
    """TaylorSeer lite on the Wan transformer against diffusers' hook on its output layer (`proj_out`), with
    guidance (WanPipeline's "cond" and "uncond" calls, each its own cache): the same steps cached, the frames within
    FRAMES_ATOL, and the cache changed them."""
    from conftest import assert_real_image, diffusers_schedule, with_diffusers_taylorseer
    from runners import TaylorSeerCacheConfig

    ours, reference = pair
    config = TaylorSeerCacheConfig(**TAYLORSEER_CASES[case])
    steps = 9
    call = dict(prompt="a red cat walking", height=64, width=64, num_frames=9, num_inference_steps=steps,
                negative_prompt="blurry")
    latents = video_noise(1, 9, 64, 64, seed=len(case))
    theirs, calls = with_diffusers_taylorseer(reference, config, "proj_out", latents=torch.from_numpy(latents),
                                              output_type="np", **call)
    cached = ours(latents=latents, cache=config, **call)
    schedule = diffusers_schedule(config, steps)
    assert calls == 2 * steps and (ours.cache_stats["full"], ours.cache_stats["cached"]) == (sum(schedule),
                                                                                              schedule.count(False))
    error, changed = float(np.abs(cached - theirs).max()), float(np.abs(cached - ours(latents=latents, **call)).max())
    print(f"wan taylorseer {case}: |ours - diffusers| {error:.1e}, the cache changed the frames by {changed:.3f}")
    assert error <= FRAMES_ATOL and changed > 1e-3
    assert_real_image(theirs)


# wan-tiny at the call below: 4 and 8 steps of 10 cached (0.03: none; 0.2: all but the first)
@pytest.mark.parametrize("threshold", (0.08, 0.12))
def test_first_block_cache_equal_to_diffusers_hooks(pair, threshold):
    """First-Block Cache on the Wan transformer's `blocks` against diffusers' `apply_first_block_cache`, WanPipeline
    deciding for "cond", then "uncond", at each step: the same decisions, the frames within FRAMES_ATOL, and the
    cache changed them."""
    from conftest import first_block_cache_against_diffusers

    call = dict(prompt="a red cat walking", height=64, width=64, num_frames=9, num_inference_steps=10,
                negative_prompt="blurry", output_type="np")
    error, changed = first_block_cache_against_diffusers(pair, threshold, video_noise(1, 9, 64, 64, seed=2), "wan",
                                                         contexts=("cond", "uncond"), **call)
    assert error <= FRAMES_ATOL and changed > 1e-3


# Every kind of the transformer's linear layers: both attentions', the feed-forward's, the embedders' and the output's
LORA_TARGETS = {"transformer": ["to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2", "proj_out", "time_proj",
                                "linear_1", "linear_2"]}


def _original_names(peft_file, out):
    """The adapter in the original checkpoint's names, which diffusers' Wan loader converts
    (`diffusion_model.blocks.0.self_attn.q.lora_down.weight`, `lora_up`, each module's alpha as a tensor)."""
    from lora_adapters import read_raw, write_raw

    from runners.families.wan.lora_keys import _BLOCK, _TOP

    tensors, metadata = read_raw(peft_file)
    alpha = np.array(json.loads(metadata["lora_adapter_metadata"])["transformer.lora_alpha"], np.float32)
    back = {v: k for k, v in {**_BLOCK, **_TOP}.items()}
    renamed = {}
    for key, value in tensors.items():
        module, kind = key.removeprefix("transformer.").rsplit(".lora_", 1)
        head, _, inner = module.partition(".") if module.startswith("blocks.") else ("", "", module)
        number, _, inner = inner.partition(".") if head else ("", "", inner)
        original = f"blocks.{number}.{back[inner]}" if head else back[inner]
        renamed[f"diffusion_model.{original}.lora_{'down' if kind.startswith('A') else 'up'}.weight"] = value
    # diffusers' converter reads an alpha in the blocks only (it refuses the others'): those read as their rank's
    alphas = {k.replace(".lora_down.weight", ".alpha"): alpha for k in renamed
              if k.endswith(".lora_down.weight") and k.startswith("diffusion_model.blocks.")}
    return write_raw(out, {**renamed, **alphas})


@pytest.mark.parametrize("spelling", ["diffusers", "original"])
def test_lora_equal_to_diffusers_fuse_lora(pair, wan_tiny_build, tmp_path, spelling):
    """A Wan adapter on every kind of the transformer's linear layers (so on its first-block graph too), in diffusers'
    format and in the original checkpoint's names, against diffusers' load_lora_weights + fuse_lora of the same file,
    with guidance; switched off, the plain frames exactly."""
    from diffusers import WanPipeline

    from lora_adapters import make_adapter
    from runners import Pipeline

    folder = wan_tiny_build.source.folder
    adapter = make_adapter(WanPipeline, folder, tmp_path / "a", LORA_TARGETS, seed=5, rank=2, alpha=1.0)
    if spelling == "original":
        adapter = _original_names(adapter, tmp_path / "original.safetensors")
    reference = WanPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    reference.load_lora_weights(adapter, adapter_name="a")
    reference.set_adapters(["a"], [0.8])
    reference.fuse_lora(adapter_names=["a"])
    call = dict(prompt="a red cat walking", height=64, width=64, num_frames=9, num_inference_steps=3,
                negative_prompt="blurry")
    latents = video_noise(1, 9, 64, 64, seed=5)
    with torch.no_grad():
        theirs = reference(latents=torch.from_numpy(latents), output_type="np", **call).frames
    loaded = Pipeline.load(wan_tiny_build.folder / "ort-fp32", loras={adapter: 0.8})
    got = loaded(latents=latents, **call)
    print(f"wan LoRA ({spelling}): |ours - diffusers| {np.abs(got - theirs).max():.1e}")
    assert np.abs(got - theirs).max() <= FRAMES_ATOL
    loaded.set_loras({})
    plain = loaded(latents=latents, **call)
    assert np.abs(theirs - plain).max() > 0.05  # the adapter changes the video
    assert np.array_equal(plain, pair[0](latents=latents, **call))


def test_prompts_are_cleaned_as_diffusers_cleans_them():
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean as theirs

    from runners.families.wan import prompt_clean

    for text in ("  a &amp;amp; b\n\tc  ", "plain", "&lt;b&gt; tag", "東京  🚀 ", ""):
        assert prompt_clean(text) == theirs(text)


def test_bad_requests_are_refused_or_adjusted_as_diffusers_does(pair, caplog):
    ours, _ = pair
    common = dict(num_inference_steps=1, output_type="latent")
    for options, said in ((dict(num_frames=0), "num_frames=0 is not allowed"),
                          (dict(num_frames=21), r"num_frames=21 is outside this artifact's range 1\.\.17"),
                          (dict(height=512), "height=512 is not allowed"),
                          (dict(output_type="pt"), "output_type='pt'"),
                          (dict(max_sequence_length=600), "max_sequence_length=600 is outside")):
        with pytest.raises(ValueError, match=said):
            ours("a cat", **{**common, **options})
    with caplog.at_level("WARNING", logger="runners"):
        latents = ours("a cat", num_frames=8, height=72, width=64, **common)
    assert latents.shape == (1, 16, 3, 8, 8)  # 9 frames of 64 x 64, as diffusers rounds them
    assert "8 frames rounded to 9" in caplog.text and "(72, 64) adjusted to (64, 64)" in caplog.text


def test_cli_writes_an_mp4_and_a_folder_of_frames(wan_tiny_build, pair, tmp_path, capsys):
    """The CLI's --out clip.mp4 decodes back (PyAV) to the pipeline's frames within H.264's loss, at the model
    card's 16 fps, with every frame; a folder gets them as PNGs, exactly; an image's path is refused."""
    from PIL import Image

    from runners.__main__ import main
    from runners.video import read_mp4

    ours, _ = pair
    artifact = str(wan_tiny_build.folder / "ort-fp32")
    args = [artifact, "--prompt", "a red cat walking", "--num-frames", "9", "--height", "64", "--width", "96",
            "--steps", "2", "--seed", "0"]
    expected = (ours("a red cat walking", num_frames=9, height=64, width=96, num_inference_steps=2, seed=0)[0]
                * 255).round()
    assert main([*args, "--out", str(tmp_path / "clip.mp4")]) == 0
    frames, fps = read_mp4(tmp_path / "clip.mp4")
    assert frames.shape == (9, 64, 96, 3) and fps == 16
    loss = float(np.abs(frames.astype(np.float32) - expected).mean())
    print(f"wan mp4 of the tiny model's frames: {loss:.1f} levels off on average")
    # measured 11.2: the random model's frames are pixel noise, whose colour 4:2:0 chroma halves (smooth frames:
    # test_the_mp4_writer_keeps_smooth_frames)
    assert loss < 20
    assert main([*args, "--out", str(tmp_path / "frames")]) == 0
    written = sorted((tmp_path / "frames").iterdir())
    assert [p.name for p in written] == [f"frame_{i:04d}.png" for i in range(9)]
    assert np.array_equal(np.stack([np.asarray(Image.open(p)) for p in written]), expected.astype(np.uint8))
    assert main([*args, "--out", str(tmp_path / "clip.png")]) == 2
    assert "this artifact makes videos" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.mp4", "frames"]


def test_the_mp4_writer_keeps_smooth_frames(tmp_path):
    """Frames like a video's (smooth, moving) come back from H.264 at crf 18 within a few levels of 255."""
    from runners.video import read_mp4, write_mp4

    y, x = np.mgrid[0:64, 0:96] / 64.0
    frames = np.stack([np.stack([np.sin(3 * x + 0.3 * t), np.cos(2 * y + 0.2 * t), np.sin(x + y + 0.1 * t)], -1)
                       for t in range(9)]).astype(np.float32) * 0.5 + 0.5
    write_mp4(frames, tmp_path / "clip.mp4", 24)
    back, fps = read_mp4(tmp_path / "clip.mp4")
    loss = np.abs(back.astype(np.float32) - (frames * 255).round())
    print(f"mp4 of smooth frames: {loss.mean():.2f} levels off on average, {loss.max():.0f} at most")
    assert back.shape == frames.shape and fps == 24
    assert loss.mean() < 3 and loss.max() < 24  # measured 1.87 and 10


def test_an_interrupted_mp4_leaves_nothing(tmp_path, monkeypatch):
    import av

    from runners.video import write_mp4

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(av.container.OutputContainer, "mux", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_mp4(np.zeros((5, 32, 32, 3), np.float32), tmp_path / "clip.mp4", 16)
    assert list(tmp_path.iterdir()) == []


def test_a_frame_range_is_checked_before_any_tracing(tmp_path):
    from export.api import export_model

    for frames, said in (([5, 9, 12], r"each 4k \+ 1"), ([9, 5, 17], "MIN <= OPT <= MAX")):
        with pytest.raises(ValueError, match=said):
            export_model("wan-tiny", tmp_path, frames=frames)
    with pytest.raises(ValueError, match="makes images, not videos"):
        export_model("sd3-tiny", tmp_path, frames=[5, 9, 17])
    assert not any(tmp_path.iterdir())


def _target_videos(artifact):
    """An artifact's two 64x64, 9-frame videos of 4 steps from fixed latents: a prompt with guidance (the default
    5), and another with a negative prompt."""
    from runners import Pipeline

    pipe = Pipeline.load(artifact)
    latents = video_noise(1, 9, 64, 64, seed=1)
    return [pipe(prompt, latents=latents, height=64, width=64, num_frames=9, num_inference_steps=4, **options)
            for prompt, options in (("a photo of a cat", {}), ("a red fox", {"negative_prompt": "blurry"}))]


# Frames' PSNR against ort-fp32 per video, measured by this test (onnxruntime 1.32, OpenVINO 2026.4.1, NNCF 3.4, a Xeon
# with VNNI, no AMX): fp16 70.6, 70.7 dB; int8 66.9, 66.6; fp8 50.7, 52.1; OpenVINO fp32 127.7, 128.2, bf16 46.3, 46.4,
# int8 36.6, 36.6 (an AMD EPYC; the VAE decoder's activations int8 too; 45.7, 45.6 with int8 weights only there), bf16
# with int8 weights 45.9, 45.9, with int4 weights 41.6, 41.5. Bounds 5 dB under each; OpenVINO's also lose the 19 dB
# CI's AMX lost on bf16 (tests/test_qwen_image.py). The suite runs fp16 and OpenVINO's bf16 and int8 for its time (ORT's
# int8 and fp8 and OpenVINO's weight compression are the shared passes the other families' tests hold; each was measured
# above once).
TARGET_MIN_PSNR = {"fp16": (65.5, 65.5), "openvino-bf16": (22.0, 22.0), "openvino-int8": (12.5, 12.5)}


def test_every_target_and_precision_within_its_bound(wan_tiny_build):
    """Every submodule (the VAE's chunk graphs and their cache included) through each target and precision, the
    pipeline's videos within their bounds; calibration runs 9-frame clips through every graph."""
    from conftest import assert_targets_within

    assert_targets_within(wan_tiny_build.folder, _target_videos, TARGET_MIN_PSNR, "wan")


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None, reason="tensorrt-rtx is not installed")
def test_tensorrt_rtx_builds_every_submodule(wan_tiny_build, monkeypatch):
    """Real fp16 engines for every submodule, the VAE's chunk graphs included; the pipeline on them through the GPU
    stand-in gives ONNX Runtime's videos exactly."""
    from conftest import assert_rtx_builds_every_submodule

    assert_rtx_builds_every_submodule(wan_tiny_build.folder, _target_videos, monkeypatch)


def test_triton_serves_frames_and_mp4(wan_tiny_build, pair, tmp_path):
    """The artifact served by a real tritonserver on 127.0.0.1: a request's frames are the Pipeline's (rounded as
    its PIL output), and its mp4 output, asked for, decodes to them with every frame at the model's fps; a request
    that asks for the frames alone gets no mp4."""
    tritonclient_http = pytest.importorskip("tritonclient.http")
    from runners.serving.repository import write_repository
    from runners.video import read_mp4
    from conftest import server_for

    ours, _ = pair
    call = dict(num_frames=5, height=64, width=64, num_inference_steps=2, seed=3)
    expected = (ours("a red cat walking", **call) * 255).round().astype(np.uint8)
    model = write_repository(wan_tiny_build.folder / "ort-fp32", tmp_path / "repository")
    with server_for(tmp_path / "repository") as server:
        client = tritonclient_http.InferenceServerClient(server.http_url)
        inputs = []
        for name, value, kind in (("prompt", b"a red cat walking", "BYTES"), *((k, v, "INT32") for k, v in call.items()
                                                                               if k != "seed"), ("seed", 3, "INT64")):
            array = np.array([[value]], dtype=object if kind == "BYTES" else np.int32 if kind == "INT32" else np.int64)
            tensor = tritonclient_http.InferInput(name, list(array.shape), kind)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        wanted = [tritonclient_http.InferRequestedOutput(n) for n in ("frames", "mp4")]
        result = client.infer(model.name, inputs, outputs=wanted)
        frames_only = client.infer(model.name, inputs, outputs=wanted[:1])
    frames = result.as_numpy("frames")
    assert frames.shape == (1, 1, 5, 64, 64, 3) and np.array_equal(frames[0], expected)
    decoded, fps = read_mp4(result.as_numpy("mp4")[0, 0])
    assert decoded.shape == (5, 64, 64, 3) and fps == 16
    assert np.abs(decoded.astype(np.float32) - frames[0, 0]).mean() < 20  # H.264 of noise-like frames: see above
    assert np.array_equal(frames_only.as_numpy("frames"), frames) and frames_only.as_numpy("mp4") is None


def test_the_openai_images_api_refuses_a_video_artifact(pair):
    from runners.serving.openai_api import create_app

    with pytest.raises(ValueError, match="makes videos, which OpenAI's images API cannot return"):
        create_app(pair[0], "wan-tiny")


@pytest.fixture(scope="module")
def pair22(wan22_tiny_build):
    from diffusers import WanPipeline

    from runners import Pipeline

    reference = WanPipeline.from_pretrained(wan22_tiny_build.source.folder)
    reference.set_progress_bar_config(disable=True)
    return Pipeline.load(wan22_tiny_build.folder / "ort-fp32"), reference


def test_wan22_hands_over_to_transformer_2_as_diffusers(pair22, wan_tiny_build, wan22_tiny_build):
    """Wan 2.2 A14B's two transformers (wan22-tiny: boundary_ratio 0.875): the steps at timesteps from 875 run
    `transformer`, the others `transformer_2`, with guidance_scale_2 (by default the first scale), equal to diffusers'
    WanPipeline; guidance_scale_2 changes the video. The text encoder's and VAE's graphs are wan-tiny's (linked); the
    second transformer's graphs are cut from the first's trace."""
    ours, reference = pair22
    calls = []
    ours.recorder = lambda submodule, feeds: calls.append(submodule)
    latents = video_noise(1, 9, 64, 64, seed=4)
    call = dict(prompt="a red cat walking", height=64, width=64, num_frames=9, num_inference_steps=6)
    videos = {}
    for scale_2 in (None, 2.0):
        options = {} if scale_2 is None else {"guidance_scale_2": scale_2}
        calls.clear()
        with torch.no_grad():
            theirs = reference(latents=torch.from_numpy(latents), output_type="np", **call, **options).frames
        videos[scale_2] = ours(latents=latents, **call, **options)
        error = float(np.abs(videos[scale_2] - theirs).max())
        print(f"wan 2.2 guidance_scale_2={scale_2}: |ours - diffusers| {error:.1e}")
        assert error <= FRAMES_ATOL
        reference.scheduler.set_timesteps(6)
        high = int((reference.scheduler.timesteps >= 875).sum())
        assert 0 < high < 6
        denoisers = [c for c in calls if c.startswith("transformer")]
        assert denoisers == ["transformer"] * high + ["transformer_2"] * (6 - high)
    assert np.abs(videos[None] - videos[2.0]).max() > 1e-3
    ours.recorder = None
    for name in ("text_encoder", "vae_decoder"):
        assert (wan22_tiny_build.folder / "onnx" / f"{name}.onnx").stat().st_ino == \
            (wan_tiny_build.folder / "onnx" / f"{name}.onnx").stat().st_ino
    from conftest import manifest

    reports = {name: s["export"] for name, s in manifest(wan22_tiny_build.folder / "onnx")["submodules"].items()}
    # transformer_2 is wan-tiny's transformer's architecture: both its graphs take that trace (the trace cache's)
    assert reports["transformer_2"]["trace_of"] == reports["transformer_2_first_block"]["trace_of"] == "trace cache"


def test_wan22_refusals(pair):
    with pytest.raises(ValueError, match="guidance_scale_2 is Wan 2.2 A14B's"):
        pair[0]("a cat", guidance_scale_2=2.0, num_inference_steps=1, output_type="latent")


def test_wan22_caches_keep_a_state_per_transformer_as_diffusers_hooks(pair22):
    """TaylorSeer lite and First-Block Cache on Wan 2.2 A14B keep a state per transformer, each counting its own
    steps from 0, as diffusers' hooks on `transformer` and on `transformer_2` do: TaylorSeer's full and cached steps
    are each transformer's schedule, FBC's decisions diffusers', the frames within FRAMES_ATOL, and each cache
    changed them. `transformer_2` runs its own first-block graph."""
    from conftest import diffusers_schedule, first_block_cache_against_diffusers, with_diffusers_taylorseer
    from runners import TaylorSeerCacheConfig

    ours, reference = pair22
    steps = 10
    call = dict(prompt="a red cat walking", height=64, width=64, num_frames=9, num_inference_steps=steps,
                negative_prompt="blurry", output_type="np")
    latents = video_noise(1, 9, 64, 64, seed=5)
    reference.scheduler.set_timesteps(steps)
    high = int((reference.scheduler.timesteps >= 875).sum())
    config = TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1)
    theirs, calls = with_diffusers_taylorseer(reference, config, "proj_out", latents=torch.from_numpy(latents), **call)
    cached = ours(latents=latents, cache=config, **call)
    schedule = diffusers_schedule(config, high) + diffusers_schedule(config, steps - high)
    assert calls == 2 * steps and (ours.cache_stats["full"], ours.cache_stats["cached"]) == (sum(schedule),
                                                                                              schedule.count(False))
    error, changed = float(np.abs(cached - theirs).max()), float(np.abs(cached - ours(latents=latents, **call)).max())
    print(f"wan 2.2 taylorseer ({high} high-noise steps of {steps}): |ours - diffusers| {error:.1e}, the cache "
          f"changed the frames by {changed:.3f}")
    assert error <= FRAMES_ATOL and changed > 1e-3
    error, changed = first_block_cache_against_diffusers(pair22, 0.08, latents, "wan 2.2", contexts=("cond", "uncond"),
                                                         **call)
    assert error <= FRAMES_ATOL and changed > 1e-3


def test_the_transformers_attentions_are_fused(wan_tiny_build):
    """Both attentions of each of wan-tiny's 2 blocks (self, and cross to the prompt) fuse into ONNX Runtime's
    attention (engines/passes); the first-block graph's one block likewise."""
    from conftest import manifest

    subs = manifest(wan_tiny_build.folder / "ort-fp32")["submodules"]
    for name, blocks in (("transformer", 2), ("transformer_first_block", 1)):
        counts = {r["name"]: r["counts"] for r in subs[name]["passes"]}
        assert counts["fuse_attention"]["attentions_fused"] == 2 * blocks, name
