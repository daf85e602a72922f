"""Stable Diffusion 1.x (StableDiffusionPipeline and its Img2Img, Inpaint and ControlNet twins): CLIP-L
and the U-Net (export/families/unet.py), as data."""
from __future__ import annotations

from export.families.parts import VAE_DECODER, VAE_DIMS, VAE_ENCODER, clip
from export.families.unet import (
    LAYOUTS, UNet, build_pipeline, constants, residual_dims, runtime_constants, unet_specs_of,
)
from export.spec import Family


def build_sd15(configs: dict, out_dir, seed: int = 0) -> None:
    build_pipeline("StableDiffusionPipeline", {"text_encoder": "CLIPTextModel"}, {"tokenizer": "<|endoftext|>"},
                   configs, out_dir, seed, safety_checker=None, feature_extractor=None, requires_safety_checker=False)


FAMILY = Family(
    name="sd15",
    pipeline_classes=("StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline", "StableDiffusionInpaintPipeline",
                      "StableDiffusionControlNetPipeline", "StableDiffusionControlNetImg2ImgPipeline",
                      "StableDiffusionControlNetInpaintPipeline"),
    submodules=(
        clip("text_encoder", "clip", ("last_hidden_state",)),
        *unet_specs_of("sd15", UNet),
        VAE_DECODER,
        VAE_ENCODER,
    ),
    constants=constants,
    runtime_constants=runtime_constants,
    derived_dims={**VAE_DIMS, **residual_dims(LAYOUTS["sd15"][0])},
    tokenizers=("tokenizer",),
    build_random=build_sd15,
    tiny_vae="taesd",
)
