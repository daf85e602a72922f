"""FLUX.1 (FluxPipeline, and its Img2Img and Inpaint pipelines; FLUX.1 Fill's FluxFillPipeline,
Canny/Depth's FluxControlPipeline and Kontext's FluxKontextPipeline): CLIP-L's pooled state, T5's
states, the Flux transformer (double-stream blocks, then single-stream ones) and the 16-channel VAE,
as data.

The transformer reads the latents packed in 2x2 patches, (batch, image tokens, 4 x channels), and
the text and image position ids, from which it builds its rotary embedding: one graph serves every
image size and text length. FLUX.1-dev's transformer also takes the guidance scale (a guidance
embedding); FLUX.1-schnell's does not, and its graph has no such input.
"""
from __future__ import annotations

import contextlib
import dataclasses
import types

import torch

from export.families.parts import (
    VAE_DECODER, VAE_DIMS, VAE_ENCODER, build_t5_pipeline, clip, clip_constants, t5_constants, t5_encoder,
    vae_runtime_constants,
)
from export.families.first_block import HIDDEN, inner_dim, transformer_specs
from export.spec import Family, SubmoduleSpec, TensorSpec as T

PACK = 2  # latents are packed in PACK x PACK patches: latent sides are multiples of it


def _rope_in_float32(self, ids):
    """diffusers' FluxPosEmbed.forward with the angles in float32 rather than float64 (as diffusers
    itself computes them on MPS): TensorRT has no float64. The angle's error is about its size
    (the position, under a few hundred) times 6e-8."""
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    pos = ids.float()
    cos, sin = zip(*(get_1d_rotary_pos_embed(dim, pos[:, i], theta=self.theta, repeat_interleave_real=True,
                                             use_real=True, freqs_dtype=torch.float32)
                     for i, dim in enumerate(self.axes_dim)))
    return torch.cat(cos, dim=-1), torch.cat(sin, dim=-1)


def export_rope(pos_embed) -> None:
    """Make a FluxPosEmbed (the transformer's, a ControlNet's) export in float32."""
    pos_embed.forward = types.MethodType(_rope_in_float32, pos_embed)


@contextlib.contextmanager
def exact_timesteps(model, timestep, guidance):
    """Give `model`'s (a transformer's, a ControlNet's) time embedding the timestep and guidance times
    1000 as they come in (float32 in an fp16 export too: the spec's "fp32_inputs"). The model itself
    casts them to its dtype first: in fp16, a timestep's rounding (1 part in 2048) times 1000 turns
    the sinusoids' fastest phases by up to a quarter radian. In float32 this changes nothing. The first call
    of the forward only: the step's."""
    exact = [timestep.float() * 1000] + ([guidance.float() * 1000] if guidance is not None else [])
    calls = []

    def substitute(_, args):
        if calls:  # FLUX.2 klein KV's second call embeds its references' fixed timestep (0): exact as it is
            return None
        calls.append(args)
        return (*exact, *args[len(exact):])

    # FLUX.1's time embedding module, or FLUX.2's
    embed = model.time_text_embed if hasattr(model, "time_text_embed") else model.time_guidance_embed
    handle = embed.register_forward_pre_hook(substitute)
    try:
        yield
    finally:
        handle.remove()


class _TransformerForFlux(torch.nn.Module):
    """The transformer with its inputs as FluxPipeline feeds them (the timestep divided by 1000, the ids
    without a batch axis); after the guidance (dev's), when the transformer takes ControlNet residuals,
    one per double-stream block then one per single-stream block (`double_residual_i`, `single_residual_j`)."""

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer
        export_rope(transformer.pos_embed)

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids, *rest):
        guidance = rest[0] if self.transformer.config.guidance_embeds else None
        residuals = rest[1:] if self.transformer.config.guidance_embeds else rest
        with exact_timesteps(self.transformer, timestep, guidance):
            out = self.transformer(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                                   pooled_projections=pooled_projections, timestep=timestep, img_ids=img_ids,
                                   txt_ids=txt_ids, guidance=guidance, return_dict=False,
                                   **self._per_block(residuals))
        return (out[0],)

    def _per_block(self, residuals) -> dict:
        """diffusers' ControlNet samples with one entry per block, so that block i adds entry i (its interval
        is 1). The first-block graph's transformer holds double block 0 only, and takes its residual."""
        if not residuals:
            return {}
        double, single = len(self.transformer.transformer_blocks), len(self.transformer.single_transformer_blocks)
        return {"controlnet_block_samples": list(residuals[:double]),
                "controlnet_single_block_samples": list(residuals[len(residuals) - single:]) if single else None}


def _has_guidance(src) -> bool:
    return bool(src.config("transformer").get("guidance_embeds"))


def _transformer(guidance: bool) -> SubmoduleSpec:
    """The transformer's description with a guidance input (dev) or without (schnell)."""
    # Example ids: positions of up to 64 patches a side (1024 pixels).
    ids = (T("img_ids", "float32", ("image_tokens", 3), high=64), T("txt_ids", "float32", ("text_length", 3), high=64))
    return SubmoduleSpec(
        name="transformer",
        component="transformer",
        inputs=(
            T("hidden_states", "float32", ("batch", "image_tokens", "packed_channels")),
            T("encoder_hidden_states", "float32", ("batch", "text_length", "joint_dim")),
            T("pooled_projections", "float32", ("batch", "pooled_dim")),
            T("timestep", "float32", ("batch",), high=1),
            *ids,
            *((T("guidance", "float32", ("batch",), high=10),) if guidance else ()),
        ),
        outputs=(T("noise_pred", "float32", ("batch", "image_tokens", "packed_out_channels")),),
        wrap=_TransformerForFlux,
        latent_divisor="latent_multiple",  # a packed token's side
        # The embedders and the final norm and projection stay in higher precision, as for SD3. The
        # final projection by its path: every single-stream block has a proj_out too.
        quantization={"denoiser": True, "keep_scopes": ("x_embedder", "time_text_embed", "context_embedder",
                                                        "norm_out", "transformer.proj_out"),
                      # fp16: the sinusoidal timestep and guidance embeddings (arguments up to a few
                      # thousand) stay fp32 (engines/passes/to_fp16.py), fed in fp32 (exact_timesteps)
                      "fp32_scopes": ("time_text_embed",), "fp32_inputs": ("timestep", "guidance")},
        when=lambda src: _has_guidance(src) == guidance,
    )


def controlled_transformer(src, configs: list[dict]) -> tuple[SubmoduleSpec]:
    """The transformer's description with a ControlNet residual input per block, double-stream then
    single-stream (export/families/controlnet_flux.py); its first-block graph stays the base's (as SD3's)."""
    config = src.config("transformer")
    residuals = tuple(T(f"{kind}_residual_{i}", "float32", HIDDEN) for kind, count in
                      (("double", config["num_layers"]), ("single", config["num_single_layers"])) for i in range(count))
    spec = _transformer(_has_guidance(src))
    return transformer_specs(dataclasses.replace(spec, inputs=spec.inputs + residuals))[:1]


def _image_tokens(dims: dict[str, int]) -> int:
    return (dims["latent_height"] // PACK) * (dims["latent_width"] // PACK)


def _constants(src) -> dict[str, int]:
    tr, vae = src.config("transformer"), src.config("vae")
    return {
        "clip_length": src.tokenizer_max_length("tokenizer"),
        **clip_constants(src.config("text_encoder"), "clip"),
        **t5_constants(src.config("text_encoder_2")),
        "joint_dim": tr["joint_attention_dim"],
        "pooled_dim": tr["pooled_projection_dim"],
        # A token holds a PACK x PACK patch of latent pixels; in_channels and out_channels count a
        # pixel's, as for the other families (more input than latent channels: an inpainting denoiser).
        "packed_channels": tr["in_channels"],
        "packed_out_channels": tr.get("out_channels") or tr["in_channels"],
        "in_channels": tr["in_channels"] // PACK**2,
        "out_channels": (tr.get("out_channels") or tr["in_channels"]) // PACK**2,
        "latent_channels": vae["latent_channels"],
        "vae_scale_factor": 2 ** (len(vae["block_out_channels"]) - 1),
        "latent_multiple": PACK,
        "inner_dim": inner_dim(tr),
        "num_train_timesteps": src.config("scheduler")["num_train_timesteps"],
    }


def _runtime_constants(src) -> dict:
    return {
        **vae_runtime_constants(src.config("vae")),
        "denoiser": "transformer",
        "latent_multiple": PACK,
        "patch_size": PACK,  # the scheduler's resolution shift counts packed tokens
        "schedule": {"sigmas": "linspace", "mu": "linear"},  # FluxPipeline's sigmas, shifted by size (dev)
        "clip_length": src.tokenizer_max_length("tokenizer"),
        # FLUX.1 Kontext's transformer is FLUX.1-dev's layout, trained to read a reference image's tokens
        # appended to the image's: only its pipeline says so.
        "reference_image": src.model_index().get("_class_name") == "FluxKontextPipeline",
    }


def build_random(configs: dict, out_dir, seed: int = 0) -> None:
    """Write a FluxPipeline folder with random seeded weights from component configs (see the registry)."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5EncoderModel

    build_t5_pipeline(configs.get("pipeline_class", "FluxPipeline"), configs, out_dir, seed, {"tokenizer": "<|endoftext|>"}, "text_encoder_2",
                      lambda t5: {
                          "transformer": lambda: FluxTransformer2DModel(**configs["transformer"]),
                          "vae": lambda: AutoencoderKL(**configs["vae"]),
                          "text_encoder": lambda: CLIPTextModel(CLIPTextConfig(**configs["text_encoder"])),
                          "text_encoder_2": lambda: T5EncoderModel(t5),
                      })


FAMILY = Family(
    name="flux",
    # One transformer serves the first three, as in diffusers; FLUX.1 Fill's reads the masked image's
    # latents and the mask as more channels, FLUX.1 Canny/Depth's a control image's latents, and FLUX.1
    # Kontext's (FLUX.1-dev's layout) a reference image's tokens after the image's; a ControlNet pipeline's
    # folder adds its ControlNet (export/families/controlnet_flux.py).
    pipeline_classes=("FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline", "FluxFillPipeline",
                      "FluxControlPipeline", "FluxKontextPipeline", "FluxControlNetPipeline"),
    submodules=(
        clip("text_encoder", "clip", ("pooler_output",)),
        t5_encoder("text_encoder_2"),
        *transformer_specs(_transformer(guidance=True)),
        *transformer_specs(_transformer(guidance=False)),
        VAE_DECODER,
        VAE_ENCODER,
    ),
    constants=_constants,
    runtime_constants=_runtime_constants,
    derived_dims={**VAE_DIMS, "image_tokens": _image_tokens},
    tokenizers=("tokenizer", "tokenizer_2"),
    build_random=build_random,
    tiny_vae="taef1",
)
