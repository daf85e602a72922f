"""Stable Diffusion XL (StableDiffusionXLPipeline and its twins): CLIP-L and CLIP-G, the U-Net with
its added conditions (export/families/unet.py), as data."""
from __future__ import annotations

from export.families.parts import VAE_DECODER, VAE_DIMS, VAE_ENCODER, clip
from export.families.unet import (
    LAYOUTS, SDXL_ADDED, UNetXL, build_pipeline, constants, residual_dims, runtime_constants, unet_specs_of,
)
from export.spec import Family


def build_sdxl(configs: dict, out_dir, seed: int = 0) -> None:
    build_pipeline("StableDiffusionXLPipeline",
                   {"text_encoder": "CLIPTextModel", "text_encoder_2": "CLIPTextModelWithProjection"},
                   {"tokenizer": "<|endoftext|>", "tokenizer_2": "!"}, configs, out_dir, seed,
                   force_zeros_for_empty_prompt=True, add_watermarker=False)


FAMILY = Family(
    name="sdxl",
    pipeline_classes=("StableDiffusionXLPipeline", "StableDiffusionXLInpaintPipeline",
                      "StableDiffusionXLControlNetPipeline", "StableDiffusionXLControlNetImg2ImgPipeline",
                      "StableDiffusionXLControlNetInpaintPipeline"),
    submodules=(
        clip("text_encoder", "clip", ("penultimate_hidden_states",)),
        clip("text_encoder_2", "clip2", ("text_embeds", "penultimate_hidden_states")),
        *unet_specs_of("sdxl", UNetXL, *SDXL_ADDED),
        VAE_DECODER,
        VAE_ENCODER,
    ),
    constants=constants,
    runtime_constants=runtime_constants,
    derived_dims={**VAE_DIMS, **residual_dims(LAYOUTS["sdxl"][0])},
    tokenizers=("tokenizer", "tokenizer_2"),
    build_random=build_sdxl,
    tiny_vae="taesdxl",
)
