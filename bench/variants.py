"""The variants a benchmark compares. Each loads once in its own worker process and answers two
jobs: one call of each submodule, and a whole text-to-image run. Inputs are numpy arrays made
from the same seeds in every variant, so every variant computes the same thing."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from bench.workload import PROMPT, T5_LENGTH, reference_images

NEGATIVE = "blurry, low quality"


def _save(images, out: str) -> list[str]:
    """The images as out/<i>.npy (a worker's reply is one line of JSON); returns the files."""
    Path(out).mkdir(parents=True)
    files = [str(Path(out) / f"{i}.npy") for i in range(len(images))]
    for f, image in zip(files, images):
        np.save(f, image)
    return files


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_calls_of(owner, attr: str, seconds: list) -> None:
    """Make `owner.attr(...)` append the seconds of each of its calls to `seconds`."""
    call = getattr(owner, attr)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = call(*args, **kwargs)
        seconds.append(time.perf_counter() - t0)
        return out

    setattr(owner, attr, timed)


def pipeline_from(source: tuple[str, str], folder: str, **components):
    """A diffusers-style pipeline, (module, class) `source` (diffusers' own in fp32, eager, or optimum-intel's
    OpenVINO one at its defaults: CPU, dynamic shapes, every model compiled at load), from `folder` (and
    `components` given), without gradients or a progress bar."""
    import importlib

    import torch

    torch.set_grad_enabled(False)
    pipe = getattr(importlib.import_module(source[0]), source[1]).from_pretrained(folder, **components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def control_options(count: int, of: int, size: int) -> dict:
    """The ControlNet arguments of a run with the first `count` of an artifact's `of` ControlNets: one seeded
    edge-like control image each (engines.calibration's), the others at scale 0 (not run). {} for none."""
    from engines.calibration import control_inputs

    if not of:
        return {}
    return {**control_inputs(size, of, seed=0), "controlnet_conditioning_scale": [1.0] * count + [0.0] * (of - count)}


def timed_result(seconds: float, steps: int, denoise: float, vae: float, image: np.ndarray, out: str | None,
                 **extra) -> dict:
    """A `timed_run` reply; the image (in [0, 1], HWC) is saved in a new file in the folder `out`."""
    import tempfile

    result = {"seconds": seconds, "step": denoise / steps, "vae": vae, **extra}
    if out:
        with tempfile.NamedTemporaryFile(dir=out, suffix=".npy", delete=False) as f:
            np.save(f, image)
        result["image"] = f.name
    return result


class Ours:
    """An artifact folder run by our numpy runner; for `timed_run`, `cache`: a step cache as `Pipeline.__call__`
    takes it, and `controls`: how many of the artifact's ControlNets run (each on its own control image);
    `vae`: the autoencoder it decodes with (`Pipeline.load`'s)."""

    def __init__(self, artifact: str, cache: str | None = None, controls: int = 0, vae: str = "full"):
        from runners import Pipeline

        self.pipe, self.cache, self.controls = Pipeline.load(artifact, vae=vae), cache, controls

    def call(self, name: str, feeds: dict) -> float:
        """One call, as a run makes it: the denoiser keeps its working memory between steps, every other
        submodule releases it after its call (a dynamic OpenVINO model's next call is then slower)."""
        release = name != self.pipe.constants["denoiser"]
        return _timed(lambda: self.pipe.run(name, release=release, **feeds))

    def text_to_image(self, latents: np.ndarray, height: int, width: int, steps: int, **options) -> np.ndarray:
        """The one text-to-image call every job of this variant makes."""
        return self.pipe(PROMPT, negative_prompt=NEGATIVE, height=height, width=width, num_inference_steps=steps,
                         latents=latents, output_type="np", **self._text_length(), **options)

    def _text_length(self) -> dict:
        """The T5 length of a family that has one (the U-Nets' CLIP length is fixed)."""
        import inspect

        takes = "max_sequence_length" in inspect.signature(self.pipe.generate).parameters
        return {"max_sequence_length": T5_LENGTH} if takes else {}

    def e2e(self, latents: np.ndarray, height: int, width: int, steps: int, **options) -> float:
        return _timed(lambda: self.text_to_image(latents, height, width, steps, **options))

    def timed_run(self, latents: np.ndarray, height: int, width: int, steps: int, out: str | None) -> dict:
        """A whole run with the variant's cache: its denoiser and VAE times, what the cache evaluated
        (`Pipeline.cache_stats`), and its image."""
        controls = control_options(self.controls, self.pipe.control_images() if self.controls else 0, height)
        t0 = time.perf_counter()
        image = self.text_to_image(latents, height, width, steps, cache=self.cache, **controls)[0]
        seconds, timings = time.perf_counter() - t0, self.pipe.timings
        return timed_result(seconds, steps, timings["denoise"], timings["vae_decode"], image, out,
                            cache=self.pipe.cache_stats)

    def images(self, prompts, latents, height: int, width: int, steps: int, out: str) -> list[str]:
        return _save([self.pipe(p, height=height, width=width, num_inference_steps=steps, latents=latents,
                                output_type="np", **self._text_length())[0] for p in prompts], out)


class OursWithoutHook(Ours):
    """The same, with `Pipeline.run` as it was before profiling existed (no profiler check): the
    A/B that shows what profiling costs when it is off."""

    def __init__(self, artifact: str):
        super().__init__(artifact)
        sessions = self.pipe.sessions
        self.pipe.run = lambda submodule, release=True, **feeds: sessions[submodule].run(feeds, release=release)


class OursProfiled(Ours):
    """The same, with `profile=` on every end-to-end run (what profiling costs)."""

    def e2e(self, latents: np.ndarray, height: int, width: int, steps: int) -> float:
        import tempfile

        with tempfile.TemporaryDirectory() as out:
            return super().e2e(latents, height, width, steps, profile=out)


class VaeDecoder:
    """Only an artifact's VAE decoder, decoding whole or in tiles (`runners.tiling`)."""

    def __init__(self, artifact: str):
        from runners import Pipeline

        self.pipe = Pipeline.load(artifact, submodules=["vae_decoder"])

    def vae_decode(self, z: np.ndarray, tiling: bool, tile: int | None) -> float:
        if not tiling:  # whole, even past the engine's declared range: what tiling saves
            return _timed(lambda: self.pipe.run("vae_decoder", latent=z))
        return _timed(lambda: self.pipe.vae_decode(z, tiling=True, tile_size=tile))


class _DiffusersCall:
    """The end-to-end call of a diffusers-style pipeline (torch latents), shared by (a), (b), (c) and
    optimum-intel."""

    def e2e(self, latents: np.ndarray, height: int, width: int, steps: int) -> float:
        return _timed(lambda: self.pipe(PROMPT, negative_prompt=NEGATIVE, height=height, width=width,
                                        num_inference_steps=steps, latents=self.torch.from_numpy(latents),
                                        output_type="np", max_sequence_length=T5_LENGTH))

    def images(self, prompts, latents, height: int, width: int, steps: int, out: str) -> list[str]:
        return _save([self.pipe(p, height=height, width=width, num_inference_steps=steps,
                                latents=self.torch.from_numpy(latents), output_type="np",
                                max_sequence_length=T5_LENGTH).images[0] for p in prompts], out)


class Diffusers(_DiffusersCall):
    """diffusers' StableDiffusion3Pipeline in fp32, eager or with torch.compile."""

    def __init__(self, folder: str, compile: bool = False):
        import torch
        from diffusers import StableDiffusion3Pipeline

        self.torch = torch
        torch.set_grad_enabled(False)
        self.pipe = StableDiffusion3Pipeline.from_pretrained(folder, torch_dtype=torch.float32)
        self.pipe.set_progress_bar_config(disable=True)
        if compile:
            self.pipe.transformer = torch.compile(self.pipe.transformer)
            self.pipe.vae.decoder = torch.compile(self.pipe.vae.decoder)

    def call(self, name: str, feeds: dict) -> float:
        t = {k: self.torch.from_numpy(v) for k, v in feeds.items()}
        p = self.pipe
        fn = {
            "text_encoder": lambda: p.text_encoder(t["input_ids"], output_hidden_states=True),
            "text_encoder_2": lambda: p.text_encoder_2(t["input_ids"], output_hidden_states=True),
            "text_encoder_3": lambda: p.text_encoder_3(t["input_ids"]),
            "transformer": lambda: p.transformer(**t, return_dict=False),
            "vae_decoder": lambda: p.vae.decode(t["latent"], return_dict=False),
        }[name]
        return _timed(fn)


class DiffusersControlNet:
    """diffusers' StableDiffusion(XL)ControlNetPipeline in fp32, eager, with the ControlNet in the folder
    `controlnet`: a step is its UNet's and its ControlNet's calls."""

    def __init__(self, folder: str, controlnet: str):
        import diffusers
        import torch

        torch.set_grad_enabled(False)
        base = diffusers.DiffusionPipeline.from_pretrained(folder, torch_dtype=torch.float32)
        name = type(base).__name__.replace("Pipeline", "ControlNetPipeline")
        self.pipe = getattr(diffusers, name)(**base.components,
                                             controlnet=diffusers.ControlNetModel.from_pretrained(controlnet))
        self.pipe.set_progress_bar_config(disable=True)
        self.torch, self.step_seconds, self.vae_seconds = torch, [], []
        time_calls_of(self.pipe.unet, "forward", self.step_seconds)
        time_calls_of(self.pipe.controlnet, "forward", self.step_seconds)
        time_calls_of(self.pipe.vae, "decode", self.vae_seconds)

    def timed_run(self, latents: np.ndarray, height: int, width: int, steps: int, out: str | None) -> dict:
        from PIL import Image

        self.step_seconds.clear()
        self.vae_seconds.clear()
        # diffusers reads a numpy (H, W, 3) array as a batch of H images: the same image, as PIL
        control = Image.fromarray((control_options(1, 1, height)["control_image"] * 255).astype(np.uint8))
        t0 = time.perf_counter()
        image = self.pipe(PROMPT, negative_prompt=NEGATIVE, image=control,
                          height=height, width=width, num_inference_steps=steps,
                          latents=self.torch.from_numpy(latents), output_type="np").images[0]
        return timed_result(time.perf_counter() - t0, steps, sum(self.step_seconds), sum(self.vae_seconds), image, out)


class Optimum(_DiffusersCall):
    """Optimum-ONNX's ORTStableDiffusion3Pipeline on Optimum's own export (in .venv-optimum)."""

    RENAMED_INPUTS = {"latent": "latent_sample"}

    def __init__(self, folder: str):
        import torch
        from optimum.onnxruntime import ORTStableDiffusion3Pipeline

        self.torch = torch
        self.pipe = ORTStableDiffusion3Pipeline.from_pretrained(folder, provider="CPUExecutionProvider")
        self.pipe.set_progress_bar_config(disable=True)

    def call(self, name: str, feeds: dict) -> float:
        session = getattr(self.pipe, name).session
        feeds = {self.RENAMED_INPUTS.get(k, k): v for k, v in feeds.items()}
        return _timed(lambda: session.run(None, feeds))


class OptimumIntel(_DiffusersCall):
    """optimum-intel's OVStableDiffusion3Pipeline on its own export (in .venv-optimum-intel), with
    its defaults: CPU, dynamic shapes, every model compiled at load."""

    RENAMED_INPUTS = {"latent": "latent_sample"}

    def __init__(self, folder: str):
        import torch
        from optimum.intel import OVStableDiffusion3Pipeline

        self.torch = torch
        self.pipe = OVStableDiffusion3Pipeline.from_pretrained(folder)
        self.pipe.set_progress_bar_config(disable=True)

    def call(self, name: str, feeds: dict) -> float:
        # Each pipeline part (pipe.text_encoder, ..., pipe.vae_decoder) holds its compiled model in
        # `request`, and calls it as below from its forward: this times the runtime alone.
        request = getattr(self.pipe, name).request
        feeds = {self.RENAMED_INPUTS.get(k, k): v for k, v in feeds.items()}
        return _timed(lambda: request(feeds, share_inputs=True))


def _as_drawn(latents: np.ndarray, shape: tuple) -> np.ndarray:
    """The starting latents in the shape openvino.genai draws them: ours, or unpatchified (FLUX.2's, which it draws
    at 32 channels and twice the side, then patchifies as diffusers does)."""
    if latents.shape == shape:
        return latents
    n, c, h, w = latents.shape
    if shape == (n, c // 4, h * 2, w * 2):
        from runners.families.flux2.tokens import unpatchify

        return np.ascontiguousarray(unpatchify(latents))
    raise ValueError(f"openvino.genai asked for latents of shape {shape}, not {latents.shape}")


class GenAI:
    """openvino.genai's Text2ImagePipeline on optimum-intel's export (in .venv-optimum-intel), on the
    CPU, at its defaults; `cache=False` turns its default step cache (TaylorSeer) off. `generate`: what
    the workload sets beyond the prompt (SD3's: `workload`; Flux's table runs the model's defaults, Z-Image's
    Turbo's guidance and a prompt of its own)."""

    pipeline = "Text2ImagePipeline"

    def __init__(self, folder: str, cache: bool = True, prompt: str = PROMPT, **generate):
        import openvino_genai

        self.genai, self.generate, self.prompt = openvino_genai, generate, prompt
        self.pipe = getattr(openvino_genai, self.pipeline)(folder, "CPU")
        if not cache:
            config = self.pipe.get_generation_config()
            config.taylorseer_config = None
            self.pipe.set_generation_config(config)

    @staticmethod
    def workload() -> dict:
        """The options of Ours.text_to_image that are not genai's defaults: the negative prompt and T5 length."""
        return {"negative_prompt": NEGATIVE, "max_sequence_length": T5_LENGTH}

    def timed_run(self, latents: np.ndarray, height: int, width: int, steps: int, out: str | None) -> dict:
        import openvino

        class Given(self.genai.Generator):  # the pipeline draws its starting latents from it: ours
            def next(self):
                raise RuntimeError("the benchmark's runs draw only their starting latents")

            def randn_tensor(self, shape):
                return openvino.Tensor(_as_drawn(latents, tuple(shape)))

        t0 = time.perf_counter()
        image, metrics = self._generate(height, width, steps, Given(), latents)
        seconds = time.perf_counter() - t0
        calls = metrics.raw_metrics.transformer_inference_durations  # microseconds, one per full evaluation
        # As Pipeline.cache_stats counts them (the time of its cached steps is not among its metrics).
        evaluations = {"full": len(calls), "cached": steps - len(calls), "full_seconds": sum(calls) / 1e6}
        text = sum(metrics.get_text_encoder_infer_duration().values()) / 1e3  # milliseconds per encoder
        return timed_result(seconds, steps, sum(calls) / 1e6, metrics.get_vae_decoder_infer_duration() / 1e3, image,
                            out, cache=evaluations, text=text)

    def _generate(self, height: int, width: int, steps: int, generator, latents) -> tuple[np.ndarray, object]:
        """(the image (H, W, 3) in [0, 1], the call's performance metrics)."""
        images = self.pipe.generate(self.prompt, height=height, width=width, num_inference_steps=steps,
                                    generator=generator, **self.generate)
        return images.data[0].astype(np.float32) / 255, self.pipe.get_performance_metrics()  # uint8 HWC


class GenAIEdit(GenAI):
    """openvino.genai's Image2ImagePipeline, as GenAI, editing from the table's one seeded reference image (FLUX.2
    klein's: the image's tokens after the noise's, as Flux2KleinPipeline takes a reference)."""

    pipeline = "Image2ImagePipeline"

    def __init__(self, folder: str, references: int = 1, **options):
        if references != 1:
            raise ValueError(f"openvino.genai's Image2ImagePipeline takes one reference image, not {references}")
        super().__init__(folder, **options)

    def _generate(self, height: int, width: int, steps: int, generator, latents) -> tuple[np.ndarray, object]:
        import openvino

        (image,) = reference_images(1, height, width)
        images = self.pipe.generate(self.prompt, openvino.Tensor(np.asarray(image)[None]), height=height, width=width,
                                    num_inference_steps=steps, generator=generator, **self.generate)
        return images.data[0].astype(np.float32) / 255, self.pipe.get_performance_metrics()  # uint8 HWC


class GenAIVideo(GenAI):
    """openvino.genai's Text2VideoPipeline (LTX-Video), as GenAI: the frames of the latents' clip."""

    pipeline = "Text2VideoPipeline"

    def _generate(self, height: int, width: int, steps: int, generator, latents) -> tuple[np.ndarray, object]:
        frames = 1 + 8 * (latents.shape[2] - 1)  # LTX-Video's 8 frames a latent frame
        result = self.pipe.generate(self.prompt, height=height, width=width, num_frames=frames,
                                    num_inference_steps=steps, generator=generator, **self.generate)
        return result.video.data[0].astype(np.float32) / 255, result.perf_metrics  # uint8 (F, H, W, 3)


class Graph:
    """One ONNX graph in a session with the runner's settings, whoever exported it: the unit of the
    pass table, where only the graph differs."""

    def __init__(self, path: str):
        from runners.backends.ort import OrtSession

        self.session = OrtSession(path)

    def call(self, name: str, feeds: dict) -> float:
        return _timed(lambda: self.session.run(feeds))  # steady state, as in the denoising loop


def make_variant(kind: str, path: str, **options):
    """The variant of `kind` (the Flux table's, "flux-...", are bench.flux_variants')."""
    if kind == "ours":
        return Ours(path, **options)
    if kind == "graph":
        return Graph(path)
    if kind == "ours-profiled":
        return OursProfiled(path)
    if kind == "ours-without-hook":
        return OursWithoutHook(path)
    if kind == "vae-decoder":
        return VaeDecoder(path)
    if kind == "diffusers-controlnet":
        return DiffusersControlNet(path, **options)
    if kind in ("diffusers", "diffusers-compile"):
        return Diffusers(path, compile=kind == "diffusers-compile")
    if kind == "optimum":
        return Optimum(path)
    if kind == "optimum-intel":
        return OptimumIntel(path)
    if kind == "genai-video":
        return GenAIVideo(path, **options)
    if kind == "genai-edit":
        return GenAIEdit(path, **options)
    if kind == "genai":
        return GenAI(path, **options)
    raise ValueError(f"unknown variant kind {kind!r}")
