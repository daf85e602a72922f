"""The variants of the tables of families whose prompt encoder is an LLM (bench/tables/family_table.py: Z-Image's,
FLUX.2's). Each makes an image of the same 20-word prompt from the same starting latents at the model's settings
(its `Workload`), editing from `references` seeded reference images where asked, and times its parts inside its
own run: the text encoder, the transformer's seconds per step and the VAE decode. diffusers' and optimum-intel's
pipelines are timed by wrapping their modules; ours by the pipeline's stage timings; openvino.genai's by its
performance metrics (bench.variants.GenAI)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from bench.variants import Ours, pipeline_from, time_calls_of, timed_result
from bench.workload import reference_images

# 20 words: the measure of the text encoder (openvino.genai pads every prompt to its maximum length)
PROMPT = ("a photo of an astronaut riding a horse on the moon at sunset, detailed, golden light, "
          "soft shadows, wide angle")


@dataclass(frozen=True)
class Workload:
    diffusers: str  # diffusers' pipeline class
    optimum_intel: str | None  # optimum-intel's (None: it has none)
    options: dict = field(default_factory=dict)  # what every run sets beyond the prompt, size, steps and latents
    folder_options: Callable[[str], dict] = lambda folder: {}  # what a diffusers-style call needs of the folder
    # the run's starting latents (N, C, h, w) as the pipelines take them (Qwen-Image's: packed)
    given_latents: Callable[[np.ndarray], np.ndarray] = lambda latents: latents
    # components diffusers' pipeline takes besides the folder's (Qwen-Image-Edit's processor, built from its parts)
    components: Callable[[str], dict] = lambda folder: {}
    temporal: str = "vae_scale_factor_temporal"  # a video pipeline's attribute holding its frames per latent frame
    # optimum-intel's export -> the outputs openvino.genai needs renamed in it, {component: {name: new name}}
    genai_renames: Callable[[Path], dict] = lambda export: {}
    # the model's source (export.source.ModelSource) -> the settings of its registry entry a diffusers run takes
    # over (given to `set_like` in the run's process), so that it does the work our artifact does
    entry_settings: Callable[[object], dict] = lambda src: {}
    set_like: Callable[..., None] = lambda **settings: None


def _flux2_layers(folder: str) -> dict:
    """Flux2KleinPipeline reads the text encoder's layers 9, 18 and 27 unless told: a shallow bench or test encoder
    names its own in its config (export.families.flux2.text_layers)."""
    from export.families.flux2 import text_layers

    config = json.loads((Path(folder) / "text_encoder" / "config.json").read_text())
    return {"text_encoder_out_layers": text_layers(config)}


def _flux2_genai_renames(export: Path) -> dict[str, dict[str, str]]:
    """What openvino.genai 2026.4.1 needs renamed in optimum-intel's FLUX.2 klein export: it reads the text encoder's
    outputs hidden_states.9, .18 and .27 (klein's layers) whatever the config's `hidden_states_layers` say, where a
    shallow bench encoder's export names them by its own layers."""
    from export.families.flux2 import TEXT_LAYERS, text_layers

    layers = text_layers(json.loads((export / "text_encoder" / "config.json").read_text()))
    renames = {f"hidden_states.{layer}": f"hidden_states.{read}" for layer, read in zip(layers, TEXT_LAYERS)
               if layer != read}
    return {"text_encoder": renames} if renames else {}


def _edit_processor(folder: str) -> dict:
    """Qwen-Image-Edit's processor without its video processor (torchvision's: export.families.qwen_image_edit)."""
    from export.families.qwen_image_edit import load_processor

    return {"processor": load_processor(folder)}


def _edit_area(src) -> dict:
    """A tiny Edit model's input-image area, smaller than the pipelines' (export.families.qwen_image_edit)."""
    from export.families.qwen_image_edit import IMAGE_AREA, image_area

    area = image_area(src)
    return {"image_area": area} if area != IMAGE_AREA else {}


def _at_edit_area(image_area: int | None = None) -> None:
    """diffusers' Edit pipelines in this process sized to `image_area`, where `_edit_area` gave one."""
    from export.families.qwen_image_edit import diffusers_at_area

    for module, name, value in diffusers_at_area(image_area) if image_area else ():
        setattr(module, name, value)


def _packed(latents: np.ndarray) -> np.ndarray:
    """Latents packed in 2 x 2 patches, as FluxPipeline and QwenImagePipeline take them."""
    from runners.latents import LatentLayout

    return LatentLayout(patch=2).pack(latents)


def _video_packed(latents: np.ndarray) -> np.ndarray:
    """A clip's latents as LTXPipeline takes them: a token a latent pixel, frame-major."""
    from runners.latents import LatentLayout

    return LatentLayout(video=True).pack(latents)


WORKLOADS = {
    # Z-Image-Turbo's guidance (its model card's): no negative prompt, one batch
    "z-image": Workload("ZImagePipeline", "OVZImagePipeline", {"guidance_scale": 0.0}),
    # FLUX.2 klein, distilled: no guidance (diffusers' default of 4 would only warn)
    "flux2": Workload("Flux2KleinPipeline", "OVFlux2KleinPipeline", {"guidance_scale": 1.0}, _flux2_layers,
                      genai_renames=_flux2_genai_renames),
    # Qwen-Image's: true CFG (its default scale, 4) with a negative prompt, latents packed
    "qwen-image": Workload("QwenImagePipeline", "OVQwenImagePipeline",
                           {"negative_prompt": "blurry, low quality, distorted", "true_cfg_scale": 4.0},
                           given_latents=_packed),
    # Wan 2.1's: guidance 5 with a negative prompt (WanPipeline's defaults); no CPU peer runs it
    "wan": Workload("WanPipeline", None, {"negative_prompt": "blurry, static, low quality", "guidance_scale": 5.0}),
    # LTX-Video's: guidance 3 with a negative prompt (LTXPipeline's scale), latents packed
    "ltx": Workload("LTXPipeline", "OVLTXPipeline", {"negative_prompt": "blurry, static, low quality",
                                                     "guidance_scale": 3.0},
                    given_latents=_video_packed, temporal="vae_temporal_compression_ratio"),
    # Qwen-Image-Edit's the same, editing its input image; no optimum-intel pipeline runs it (#1934 is open)
    "qwen-image-edit": Workload("QwenImageEditPipeline", None,
                                {"negative_prompt": "blurry, low quality, distorted", "true_cfg_scale": 4.0},
                                given_latents=_packed, components=_edit_processor, entry_settings=_edit_area,
                                set_like=_at_edit_area),
}


def _edit(references: int, height: int, width: int) -> dict:
    """The images to edit from: one as the image itself. QwenImageEditPipeline resizes a list's images for the VAE
    but hands the vision tower them as given (VaeImageProcessor.resize returns a list unchanged): a list of one
    512x512 image would give diffusers a third of the prompt tokens our runner (and diffusers on the image) encode."""
    if not references:
        return {}
    images = reference_images(references, height, width)
    return {"image": images[0] if references == 1 else images}


def _video(latents: np.ndarray, temporal: int | None) -> dict:
    """A video's frame count, from its latents (1, C, f, h, w): the first frame alone, then `temporal` frames a
    latent frame."""
    return {"num_frames": 1 + temporal * (latents.shape[2] - 1)} if latents.ndim == 5 else {}


class FamilyOurs(Ours):
    """Our artifact on the workload; `cache`: a step cache for every run (Pipeline.__call__'s)."""

    def __init__(self, artifact: str, workload: str, references: int = 0, cache: str | None = None):
        super().__init__(artifact, cache=cache)
        self.workload, self.references = WORKLOADS[workload], references

    def timed_run(self, latents: np.ndarray, height: int, width: int, steps: int, out: str | None) -> dict:
        edit = _edit(self.references, height, width)
        t0 = time.perf_counter()
        image = self.pipe(PROMPT, height=height, width=width, num_inference_steps=steps,
                          latents=self.workload.given_latents(latents), output_type="np", cache=self.cache,
                          **_video(latents, self.pipe.constants.get("vae_temporal_scale")),
                          **self.workload.options, **edit)[0]
        seconds, timings = time.perf_counter() - t0, self.pipe.timings
        return timed_result(seconds, steps, timings["denoise"], timings["vae_decode"], image, out,
                            text=timings["text_encoders"], cache=self.pipe.cache_stats)


class FamilyPipeline:
    """A diffusers-style pipeline of the workload's (diffusers' own in fp32, eager; or optimum-intel's on its own
    export, at its defaults), its text encoder, transformer and VAE timed."""

    def __init__(self, folder: str, workload: str, source: str, references: int = 0, settings: dict | None = None):
        w = WORKLOADS[workload]
        w.set_like(**settings or {})
        self.pipe = pipeline_from(("diffusers", w.diffusers), folder, **w.components(folder)) \
            if source == "diffusers" else pipeline_from(("optimum.intel", w.optimum_intel), folder)
        self.options, self.references = {**w.options, **w.folder_options(folder)}, references
        self.given_latents, self.temporal = w.given_latents, w.temporal
        self.text_seconds, self.step_seconds, self.vae_seconds = [], [], []
        time_calls_of(self.pipe.text_encoder, "forward", self.text_seconds)
        time_calls_of(self.pipe.transformer, "forward", self.step_seconds)
        time_calls_of(self.pipe.vae, "decode", self.vae_seconds)

    def timed_run(self, latents: np.ndarray, height: int, width: int, steps: int, out: str | None) -> dict:
        import torch

        for seconds in (self.text_seconds, self.step_seconds, self.vae_seconds):
            seconds.clear()
        edit = _edit(self.references, height, width)
        t0 = time.perf_counter()
        image = self.pipe(prompt=PROMPT, height=height, width=width, num_inference_steps=steps,
                          latents=torch.from_numpy(self.given_latents(latents)), output_type="np",
                          **_video(latents, getattr(self.pipe, self.temporal, None)),
                          **self.options, **edit)[0][0]  # the output's images (a video pipeline's frames)
        return timed_result(time.perf_counter() - t0, steps, sum(self.step_seconds), sum(self.vae_seconds), image, out,
                            text=sum(self.text_seconds))


class VideoDecoderOurs:
    """A video artifact's chunked VAE decoder alone (its two graphs, looped over the latent frames)."""

    def __init__(self, artifact: str):
        from runners import Pipeline

        self.pipe = Pipeline.load(artifact, submodules=["vae_decoder_first", "vae_decoder"])

    def vae_decode(self, z: np.ndarray, tiling: bool, tile: int | None) -> float:
        t0 = time.perf_counter()
        self.pipe.decode_video(z)
        return time.perf_counter() - t0


class VideoDecoderDiffusers:
    """diffusers' AutoencoderKLWan of the folder, eager fp32, decoding the pipeline's latents as WanPipeline does."""

    def __init__(self, folder: str):
        import torch
        from diffusers import AutoencoderKLWan

        torch.set_grad_enabled(False)
        self.torch, self.vae = torch, AutoencoderKLWan.from_pretrained(Path(folder) / "vae")

    def vae_decode(self, z: np.ndarray, tiling: bool, tile: int | None) -> float:
        config = self.vae.config
        mean = self.torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1)
        std = self.torch.tensor(config.latents_std).view(1, -1, 1, 1, 1)
        t0 = time.perf_counter()
        self.vae.decode(self.torch.from_numpy(z) / (1.0 / std) + mean, return_dict=False)
        return time.perf_counter() - t0


# a video workload's VAE decoder alone (the video table's memory rows)
RUNNERS = {"vae-ours": VideoDecoderOurs, "vae-diffusers": VideoDecoderDiffusers}


def make_family_variant(kind: str, path: str, **options):
    """"<workload>-ours", "<workload>-diffusers" or "<workload>-optimum-intel" (WORKLOADS' names); a video
    workload's VAE decoder alone, "<workload>-vae-ours" or "-vae-diffusers"."""
    workload = max((w for w in WORKLOADS if kind.startswith(w + "-")), key=len, default=None)  # qwen-image-edit-*
    runner = kind[len(workload) + 1:] if workload else None
    if runner == "ours":
        return FamilyOurs(path, workload, **options)
    if runner in RUNNERS:
        return RUNNERS[runner](path, **options)
    if runner in ("diffusers", "optimum-intel"):
        return FamilyPipeline(path, workload, runner, **options)
    raise ValueError(f"unknown variant kind {kind!r}: <workload>-ours, -diffusers, -optimum-intel, -vae-ours or "
                     f"-vae-diffusers, of {', '.join(WORKLOADS)}")
