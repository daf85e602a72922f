"""Stable Diffusion 3 / 3.5 (StableDiffusion3Pipeline): six submodules, as data.

The wrappers select the outputs SD3 actually uses, so the graphs carry nothing the runner
throws away (CLIP's last hidden state, the VAE's posterior object, ...).
"""
from __future__ import annotations

import types

import torch

from export.spec import Family, SubmoduleSpec, TensorSpec as T


class _ClipForSD3(torch.nn.Module):
    """Pooled projected embedding and the penultimate hidden state (SD3's clip_skip=None)."""

    def __init__(self, clip):
        super().__init__()
        self.clip = clip

    def forward(self, input_ids):
        out = self.clip(input_ids, output_hidden_states=True)
        return out.text_embeds, out.hidden_states[-2]


class _T5ForSD3(torch.nn.Module):
    def __init__(self, t5):
        super().__init__()
        self.t5 = t5

    def forward(self, input_ids):
        return (self.t5(input_ids).last_hidden_state,)


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


class _TransformerForSD3(torch.nn.Module):
    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer
        embed = transformer.pos_embed
        if embed.pos_embed_max_size is not None:
            embed.cropped_pos_embed = types.MethodType(_cropped_pos_embed, embed)

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep):
        out = self.transformer(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            pooled_projections=pooled_projections,
            timestep=timestep,
            return_dict=False,
        )
        return (out[0],)


class _VaeDecoder(torch.nn.Module):
    """Latents already unscaled by the runner ((z / scaling) + shift) -> image in [-1, 1]."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, latent):
        return (self.vae.decode(latent, return_dict=False)[0],)


class _VaeEncoder(torch.nn.Module):
    """Image in [-1, 1] -> the posterior's mean and log-variance (the runner samples or takes the mean)."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, image):
        posterior = self.vae.encode(image, return_dict=False)[0]
        return posterior.mean, posterior.logvar


def _clip(name: str, width: str, proj: str, vocab: str) -> SubmoduleSpec:
    return SubmoduleSpec(
        name=name,
        component=name,
        inputs=(T("input_ids", "int64", ("batch", "clip_length"), high=vocab),),
        outputs=(
            T("text_embeds", "float32", ("batch", proj)),
            T("penultimate_hidden_states", "float32", ("batch", "clip_length", width)),
        ),
        wrap=_ClipForSD3,
    )


def _constants(src) -> dict[str, int]:
    tr, vae = src.config("transformer"), src.config("vae")
    clip, clip2 = src.config("text_encoder"), src.config("text_encoder_2")
    c = {
        "clip_length": src.tokenizer_max_length("tokenizer"),
        "clip_width": clip["hidden_size"], "clip_proj": clip["projection_dim"], "clip_vocab": clip["vocab_size"],
        "clip2_width": clip2["hidden_size"], "clip2_proj": clip2["projection_dim"], "clip2_vocab": clip2["vocab_size"],
        "joint_dim": tr["joint_attention_dim"],
        "pooled_dim": tr["pooled_projection_dim"],
        "in_channels": tr["in_channels"],
        "out_channels": tr["out_channels"],
        "latent_channels": vae["latent_channels"],
        "vae_scale_factor": 2 ** (len(vae["block_out_channels"]) - 1),
        "num_train_timesteps": src.config("scheduler")["num_train_timesteps"],
    }
    if src.has("text_encoder_3"):
        t5 = src.config("text_encoder_3")
        c.update(t5_width=t5["d_model"], t5_vocab=t5["vocab_size"])
    return c


def _runtime_constants(src) -> dict:
    c = _constants(src)
    tr, vae = src.config("transformer"), src.config("vae")
    return {
        "vae_scaling_factor": vae["scaling_factor"],
        "vae_shift_factor": vae.get("shift_factor") or 0.0,
        "vae_scale_factor": c["vae_scale_factor"],
        "patch_size": tr["patch_size"],
        "latent_channels": tr["in_channels"],
        "joint_attention_dim": tr["joint_attention_dim"],
        "clip_length": c["clip_length"],
    }


def build_random(configs: dict, out_dir, seed: int = 0) -> None:
    """Write a StableDiffusion3Pipeline folder with random seeded weights from component configs.

    `configs` holds one config dict per component (see the registry); the tokenizers are the
    real CLIP vocabulary and an offline-trained T5 SentencePiece model.
    """
    import tempfile
    from pathlib import Path

    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from diffusers import StableDiffusion3Pipeline
    from transformers import (
        AutoTokenizer, CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel,
    )

    from export.offline_tokenizers import write_clip_tokenizer, write_t5_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tok = {}
        for name, pad in (("tokenizer", "<|endoftext|>"), ("tokenizer_2", "!")):
            write_clip_tokenizer(Path(tmp, name), pad_token=pad)
            tok[name] = AutoTokenizer.from_pretrained(Path(tmp, name))
        t5_vocab = write_t5_tokenizer(Path(tmp, "tokenizer_3"), configs["t5_vocab_pieces"], seed)
        tok["tokenizer_3"] = AutoTokenizer.from_pretrained(Path(tmp, "tokenizer_3"))

        def seeded(offset, make):
            torch.manual_seed(seed + offset)
            return make().eval()

        pipe = StableDiffusion3Pipeline(
            transformer=seeded(0, lambda: SD3Transformer2DModel(**configs["transformer"])),
            vae=seeded(1, lambda: AutoencoderKL(**configs["vae"])),
            text_encoder=seeded(2, lambda: CLIPTextModelWithProjection(CLIPTextConfig(**configs["text_encoder"]))),
            text_encoder_2=seeded(3, lambda: CLIPTextModelWithProjection(CLIPTextConfig(**configs["text_encoder_2"]))),
            text_encoder_3=seeded(4, lambda: T5EncoderModel(T5Config(vocab_size=t5_vocab, **configs["text_encoder_3"]))),
            scheduler=FlowMatchEulerDiscreteScheduler(**configs["scheduler"]),
            **tok,
        )
        pipe.save_pretrained(out_dir, safe_serialization=True)


FAMILY = Family(
    name="sd3",
    pipeline_class="StableDiffusion3Pipeline",
    submodules=(
        _clip("text_encoder", "clip_width", "clip_proj", "clip_vocab"),
        _clip("text_encoder_2", "clip2_width", "clip2_proj", "clip2_vocab"),
        SubmoduleSpec(
            name="text_encoder_3",
            component="text_encoder_3",
            inputs=(T("input_ids", "int64", ("batch", "t5_length"), high="t5_vocab"),),
            outputs=(T("last_hidden_state", "float32", ("batch", "t5_length", "t5_width")),),
            wrap=_T5ForSD3,
            # T5's default (sdpa) attention does not export under dynamo; eager does.
            load_kwargs={"attn_implementation": "eager"},
        ),
        SubmoduleSpec(
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
            # NVIDIA's fp8 recipe for SD3 keeps the embedders and the final norm and projection in
            # higher precision: their errors reach every block or the output directly.
            quantization={"denoiser": True, "keep_scopes": ("pos_embed", "time_text_embed", "context_embedder",
                                                            "norm_out", "proj_out")},
        ),
        SubmoduleSpec(
            name="vae_decoder",
            component="vae",
            inputs=(T("latent", "float32", ("batch", "latent_channels", "latent_height", "latent_width")),),
            outputs=(T("image", "float32", ("batch", 3, "image_height", "image_width")),),
            wrap=_VaeDecoder,
        ),
        SubmoduleSpec(
            name="vae_encoder",
            component="vae",
            inputs=(T("image", "float32", ("batch", 3, "image_height", "image_width")),),
            outputs=(
                T("latent_mean", "float32", ("batch", "latent_channels", "latent_height", "latent_width")),
                T("latent_logvar", "float32", ("batch", "latent_channels", "latent_height", "latent_width")),
            ),
            wrap=_VaeEncoder,
        ),
    ),
    constants=_constants,
    runtime_constants=_runtime_constants,
    derived_dims={
        "image_height": ("latent_height", "vae_scale_factor", 0),
        "image_width": ("latent_width", "vae_scale_factor", 0),
        "joint_length": ("t5_length", 1, "clip_length"),
    },
    tokenizers=("tokenizer", "tokenizer_2", "tokenizer_3"),
    build_random=build_random,
)
