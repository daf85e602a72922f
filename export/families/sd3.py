"""Stable Diffusion 3 / 3.5 (StableDiffusion3Pipeline): six submodules, as data."""
from __future__ import annotations

import types

import torch

from export.families.parts import (
    VAE_DECODER, VAE_DIMS, VAE_ENCODER, build_t5_pipeline, clip, clip_constants, t5_constants, t5_encoder,
    vae_runtime_constants,
)
from export.families.first_block import block_residuals, inner_dim, transformer_specs, with_block_residuals
from export.spec import Family, SubmoduleSpec, TensorSpec as T

_CLIP_OUTPUTS = ("text_embeds", "penultimate_hidden_states")


def _cropped_pos_embed(self, height, width):
    """diffusers' PatchEmbed.cropped_pos_embed with the crop offset written so that it exports right.

    diffusers computes top = (M - h) // 2. The tracer rewrites that as M // 2 + (-h) // 2, and the
    ONNX graph divides the negative -h with truncation instead of floor: every odd patch count
    (an image side of 16 mod 32 pixels) then crops the wrong window and fails to broadcast.
    M // 2 - (h + 1 - M % 2) // 2 is the same integer with a non-negative numerator.
    """
    m = self.pos_embed_max_size
    h, w = height // self.patch_size, width // self.patch_size
    if h > m or w > m:
        raise ValueError(f"latent of {h}x{w} patches exceeds pos_embed_max_size {m}")
    top = m // 2 - (h + 1 - m % 2) // 2
    left = m // 2 - (w + 1 - m % 2) // 2
    grid = self.pos_embed.reshape(1, m, m, -1)[:, top : top + h, left : left + w, :]
    return grid.reshape(1, -1, grid.shape[-1])


def export_cropping(embed) -> None:
    """Make a PatchEmbed (the transformer's, a ControlNet's) crop its position embedding as exports right."""
    if embed.pos_embed_max_size is not None:
        embed.cropped_pos_embed = types.MethodType(_cropped_pos_embed, embed)


class _TransformerForSD3(torch.nn.Module):
    """Inputs as declared; after them, when the transformer takes ControlNet residuals, one per block that
    adds one (`block_residual_i`, in block order)."""

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer
        export_cropping(transformer.pos_embed)

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, *residuals):
        out = self.transformer(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            pooled_projections=pooled_projections,
            timestep=timestep,
            block_controlnet_hidden_states=_per_block(self.transformer.transformer_blocks, residuals),
            return_dict=False,
        )
        return (out[0],)


def _per_block(blocks, residuals) -> list | None:
    """diffusers' block_controlnet_hidden_states with one entry per block, so that block i adds entry i
    (its interval is 1); a block that adds none (context_pre_only) gets None, which it never reads."""
    if not residuals:
        return None
    given = iter(residuals)
    return [None if block.context_pre_only else next(given) for block in blocks]


TRANSFORMER = SubmoduleSpec(
    name="transformer",
    component="transformer",
    inputs=(
        T("hidden_states", "float32", ("batch", "in_channels", "latent_height", "latent_width")),
        T("encoder_hidden_states", "float32", ("batch", "joint_length", "joint_dim")),
        T("pooled_projections", "float32", ("batch", "pooled_dim")),
        T("timestep", "float32", ("batch",), high="num_train_timesteps"),
    ),
    outputs=(T("noise_pred", "float32", ("batch", "out_channels", "latent_height", "latent_width")),),
    wrap=_TransformerForSD3,
    latent_divisor="latent_multiple",  # its patch
    # NVIDIA's fp8 recipe for SD3 keeps the embedders and the final norm and projection in
    # higher precision: their errors reach every block or the output directly.
    quantization={"denoiser": True, "keep_scopes": ("pos_embed", "time_text_embed", "context_embedder",
                                                    "norm_out", "proj_out")},
)


def controlled_transformer(src, configs: list[dict]) -> tuple[SubmoduleSpec]:
    """The transformer's description with a ControlNet residual input per block that adds one: all but the
    last, whose image stream ends there (context_pre_only). Its first-block graph stays the base's: a cached
    step would skip the residuals, so First-Block Cache never runs with ControlNets."""
    residuals = block_residuals(range(src.config("transformer")["num_layers"] - 1))
    return (with_block_residuals(TRANSFORMER, residuals, TRANSFORMER.wrap),)


PATCH = 2  # SD3 and 3.5 transformers read the latents in 2x2 patches


def _image_tokens(dims: dict[str, int]) -> int:
    return (dims["latent_height"] // PATCH) * (dims["latent_width"] // PATCH)


def _constants(src) -> dict[str, int]:
    tr, vae = src.config("transformer"), src.config("vae")
    if tr["patch_size"] != PATCH:
        raise ValueError(f"SD3 transformer patch_size={tr['patch_size']}: this family exports patch size {PATCH} only")
    clip, clip2 = src.config("text_encoder"), src.config("text_encoder_2")
    c = {
        "clip_length": src.tokenizer_max_length("tokenizer"),
        **clip_constants(clip, "clip"), **clip_constants(clip2, "clip2"),
        "joint_dim": tr["joint_attention_dim"],
        "pooled_dim": tr["pooled_projection_dim"],
        "in_channels": tr["in_channels"],
        "out_channels": tr["out_channels"],
        "latent_channels": vae["latent_channels"],
        "vae_scale_factor": 2 ** (len(vae["block_out_channels"]) - 1),
        "latent_multiple": tr["patch_size"],  # latent sides are whole patches
        "inner_dim": inner_dim(tr),
        "num_train_timesteps": src.config("scheduler")["num_train_timesteps"],
    }
    if src.has("text_encoder_3"):
        c.update(t5_constants(src.config("text_encoder_3")))
    return c


def _runtime_constants(src) -> dict:
    c = _constants(src)
    tr, vae = src.config("transformer"), src.config("vae")
    return {
        **vae_runtime_constants(vae),
        "denoiser": "transformer",
        "latent_multiple": c["latent_multiple"],
        "patch_size": tr["patch_size"],
        "schedule": {"sigmas": None, "mu": "linear"},  # the scheduler's sigmas; SD3.5's configs shift them by size
        "joint_attention_dim": tr["joint_attention_dim"],
        "clip_length": c["clip_length"],
    }


def build_random(configs: dict, out_dir, seed: int = 0) -> None:
    """Write a StableDiffusion3Pipeline folder with random seeded weights from component configs (see
    the registry)."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5EncoderModel

    build_t5_pipeline("StableDiffusion3Pipeline", configs, out_dir, seed,
                      {"tokenizer": "<|endoftext|>", "tokenizer_2": "!"}, "text_encoder_3", lambda t5: {
                          "transformer": lambda: SD3Transformer2DModel(**configs["transformer"]),
                          "vae": lambda: AutoencoderKL(**configs["vae"]),
                          "text_encoder": lambda: CLIPTextModelWithProjection(CLIPTextConfig(**configs["text_encoder"])),
                          "text_encoder_2": lambda: CLIPTextModelWithProjection(
                              CLIPTextConfig(**configs["text_encoder_2"])),
                          "text_encoder_3": lambda: T5EncoderModel(t5),
                      })


FAMILY = Family(
    name="sd3",
    # One 16-channel transformer serves all three, as in diffusers; a ControlNet pipeline's folder adds
    # its ControlNet (export/families/controlnet_sd3.py).
    pipeline_classes=("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline", "StableDiffusion3InpaintPipeline",
                      "StableDiffusion3ControlNetPipeline"),
    submodules=(
        clip("text_encoder", "clip", _CLIP_OUTPUTS),
        clip("text_encoder_2", "clip2", _CLIP_OUTPUTS),
        t5_encoder("text_encoder_3"),
        *transformer_specs(TRANSFORMER, block_outputs=True),
        VAE_DECODER,
        VAE_ENCODER,
    ),
    constants=_constants,
    runtime_constants=_runtime_constants,
    derived_dims={
        **VAE_DIMS,
        "joint_length": ("text_length", 1, "clip_length"),
        "image_tokens": _image_tokens,
    },
    tokenizers=("tokenizer", "tokenizer_2", "tokenizer_3"),
    build_random=build_random,
    tiny_vae="taesd3",
)
