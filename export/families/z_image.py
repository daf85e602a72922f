"""Z-Image and Z-Image-Turbo (ZImagePipeline, and its Img2Img and Inpaint pipelines): a Qwen3 LLM's
second-to-last hidden states, the single-stream Z-Image transformer and FLUX.1's 16-channel VAE, as data.

The text encoder stops one layer short of its last (export/families/llm_encoder.py); the runner runs it
on the call's longest prompt and keeps each prompt's own tokens. The transformer's forward takes lists
(one latent and one caption of its own length per image) and builds its rotary embedding from complex
numbers, which ONNX has not: its graph takes padded tensors and each caption's length, and computes
diffusers' forward on them in real arithmetic (`_PaddedForward`): each caption padded with the learned
pad token to a multiple of 32, the image's positions after its own caption's, the other captions'
longer padding masked out of attention. One graph serves every batch, image size and caption length,
and a batch of captions of different lengths (the prompt and the negative prompt) in one call.
"""
from __future__ import annotations

import torch

from export.families.first_block import transformer_specs
from export.families.llm_encoder import llm_constants, llm_encoder
from export.families.parts import VAE_DECODER, VAE_DIMS, VAE_ENCODER, vae_runtime_constants
from export.spec import Family, PromptFormat, SubmoduleSpec, TensorSpec as T

PATCH = 2  # the transformer's patch: latent sides are multiples of it
TEXT_LAYERS = (-2,)  # ZImagePipeline reads hidden_states[-2]
SEQ_MULTIPLE = 32  # captions and image tokens are padded to multiples of it (diffusers' SEQ_MULTI_OF)


def _real_rope_tables(axes_dims, axes_lens, theta) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(cos, sin) per axis, (length, dim / 2) float32: the angles of diffusers' complex table
    (RopeEmbedder.precompute_freqs_cis: float64 products rounded to float32)."""
    tables = []
    for dim, length in zip(axes_dims, axes_lens):
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        angles = torch.outer(torch.arange(length, dtype=torch.float64), freqs).float()
        tables.append((torch.cos(angles), torch.sin(angles)))
    return tables


def _rotated(x, freqs):
    """x (B, S, heads, D) times e^(i angle) on its (even, odd) pairs; freqs (B, S, D / 2, 2): cos, sin."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = freqs[..., 0].unsqueeze(2), freqs[..., 1].unsqueeze(2)
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(3).type_as(x)


class _RealRopeAttention:
    """diffusers' ZSingleStreamAttnProcessor with the rotary embedding in real arithmetic."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, freqs_cis=None):
        q, k, v = (proj(hidden_states).unflatten(-1, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if freqs_cis is not None:
            q, k = _rotated(q, freqs_cis), _rotated(k, freqs_cis)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attention_mask).transpose(1, 2)
        out = attn.to_out[0](out.flatten(2, 3).to(q.dtype))
        return attn.to_out[1](out) if len(attn.to_out) > 1 else out


def _additive(mask, dtype):
    """A key mask (B, S) as attention's additive bias (B, 1, 1, S): the exporter lowers a boolean mask to
    several passes over the whole score tensor, an additive one to one Add (measured 1.6x faster on
    z-image-tiny). No row is wholly masked: every query sees its own caption's or image's tokens."""
    return torch.where(mask, 0.0, torch.finfo(dtype).min).to(dtype)[:, None, None, :]


def _ceil(n, multiple=SEQ_MULTIPLE):
    return n + (-n) % multiple


class _PaddedForward(torch.nn.Module):
    """(latent (B, C, H, W), timestep (B,) as the pipeline passes it, caption (B, L, width) right-padded,
    caption_lengths (B,)) -> the transformer's output (B, C, H, W): diffusers' forward on
    [latent[i][:, None]] and [caption[i, :caption_lengths[i]]], stacked."""

    def __init__(self, model):
        super().__init__()
        from diffusers.models.attention_processor import Attention

        self.transformer = model
        for module in model.modules():
            if isinstance(module, Attention):
                module.processor = _RealRopeAttention()
        for i, (cos, sin) in enumerate(_real_rope_tables(model.axes_dims, model.axes_lens, model.rope_theta)):
            self.register_buffer(f"cos{i}", cos, persistent=False)
            self.register_buffer(f"sin{i}", sin, persistent=False)

    def _freqs(self, *positions):
        cos = torch.cat([getattr(self, f"cos{i}")[p] for i, p in enumerate(positions)], dim=-1)
        sin = torch.cat([getattr(self, f"sin{i}")[p] for i, p in enumerate(positions)], dim=-1)
        return torch.stack([cos, sin], dim=-1)

    def forward(self, latent, timestep, caption, caption_lengths):
        m = self.transformer
        batch, channels, height, width = latent.shape
        rows, cols = height // PATCH, width // PATCH
        n_image, length = rows * cols, caption.shape[1]
        image_slots, caption_slots = _ceil(n_image), _ceil(length)
        adaln = m.t_embedder(timestep * m.t_scale).type_as(latent)

        # Each caption: its tokens, then the learned pad token up to its own multiple of 32 (and on to the
        # longest's, masked); positions (1 + k, 0, 0).
        k = torch.arange(caption_slots, device=latent.device)
        cap = m.cap_embedder(caption)
        cap = torch.cat([cap, m.cap_pad_token.expand(batch, caption_slots - length, -1).to(cap.dtype)], dim=1)
        cap = torch.where((k[None] >= caption_lengths[:, None])[..., None], m.cap_pad_token.to(cap.dtype), cap)
        padded_lengths = (caption_lengths + SEQ_MULTIPLE - 1) // SEQ_MULTIPLE * SEQ_MULTIPLE
        cap_mask = k[None] < padded_lengths[:, None]
        zeros = torch.zeros_like(k)
        cap_freqs = self._freqs(k + 1, zeros, zeros).unsqueeze(0).expand(batch, -1, -1, -1)

        # The image: 2x2 patches in diffusers' order (row, column, channel), padded to a multiple of 32 with
        # the learned pad token at position (0, 0, 0); real patches at (caption's padded length + 1, row, col).
        x = latent.reshape(batch, channels, rows, PATCH, cols, PATCH).permute(0, 2, 4, 3, 5, 1)
        x = m.all_x_embedder[f"{PATCH}-1"](x.reshape(batch, n_image, PATCH * PATCH * channels))
        x = torch.cat([x, m.x_pad_token.expand(batch, image_slots - n_image, -1).to(x.dtype)], dim=1)
        pad = torch.zeros(image_slots - n_image, dtype=torch.int64, device=latent.device)
        # (no `j % cols`: onnxscript cannot translate a remainder by a symbolic size)
        row = torch.cat([torch.arange(rows, device=latent.device)[:, None].expand(rows, cols).reshape(n_image), pad])
        col = torch.cat([torch.arange(cols, device=latent.device)[None, :].expand(rows, cols).reshape(n_image), pad])
        real = torch.arange(image_slots, device=latent.device) < n_image
        first = torch.where(real[None], padded_lengths[:, None] + 1, 0)
        x_freqs = self._freqs(first, row.expand(batch, -1), col.expand(batch, -1))

        for layer in m.noise_refiner:
            x = layer(x, None, x_freqs, adaln)
        for layer in m.context_refiner:
            cap = layer(cap, _additive(cap_mask, cap.dtype), cap_freqs)
        joint = torch.cat([x, cap], dim=1)
        joint_freqs = torch.cat([x_freqs, cap_freqs], dim=1)
        joint_mask = torch.cat([torch.ones(batch, image_slots, dtype=torch.bool, device=latent.device), cap_mask], 1)
        joint_mask = _additive(joint_mask, joint.dtype)
        for layer in m.layers:
            joint = layer(joint, joint_mask, joint_freqs, adaln)
        joint = m.all_final_layer[f"{PATCH}-1"](joint, c=adaln)
        out = joint[:, :n_image].reshape(batch, rows, cols, PATCH, PATCH, channels)
        return (out.permute(0, 5, 1, 3, 2, 4).reshape(batch, channels, height, width),)


_LATENT = ("batch", "latent_channels", "latent_height", "latent_width")
TRANSFORMER = SubmoduleSpec(
    name="transformer",
    component="transformer",
    inputs=(T("latent", "float32", _LATENT), T("timestep", "float32", ("batch",), high=1),
            T("caption", "float32", ("batch", "text_length", "text_width")),
            T("caption_lengths", "int64", ("batch",), high="text_length", low=1)),
    outputs=(T("noise_pred", "float32", _LATENT),),
    wrap=_PaddedForward,
    # An fp16 export takes the timestep in fp32: the embedding's sinusoids of 1000 t turn by up to a quarter
    # radian at fp16's spacing (as FLUX.1's, export/families/flux.py)
    quantization={"denoiser": True, "fp32_inputs": ("timestep",)},
    latent_divisor=PATCH,
)
# The blocks' hidden stream (First-Block Cache's residuals): the image's tokens, then the caption's, each
# padded to a multiple of 32
HIDDEN = ("batch", "hidden_tokens", "inner_dim")


def _hidden_tokens(dims: dict[str, int]) -> int:
    return _ceil((dims["latent_height"] // PATCH) * (dims["latent_width"] // PATCH)) + _ceil(dims["text_length"])


def _constants(src) -> dict[str, int]:
    tr, vae = src.config("transformer"), src.config("vae")
    return {
        **llm_constants(src.config("text_encoder"), TEXT_LAYERS),
        "latent_channels": vae["latent_channels"],
        "in_channels": tr["in_channels"],
        "vae_scale_factor": 2 ** (len(vae["block_out_channels"]) - 1),
        "latent_multiple": PATCH,
        "num_train_timesteps": src.config("scheduler")["num_train_timesteps"],
        "caption_dim": tr["cap_feat_dim"],
        "inner_dim": tr["dim"],
    }


def _runtime_constants(src) -> dict:
    # Turbo's defaults differ (8 steps, no guidance) and nothing in its folder's configs says which it is but
    # its scheduler's shift: the registry's entry says, or the folder's name
    variant = src.entry.extra.get("variant") or ("turbo" if "turbo" in str(src.folder).lower() else "base")
    return {**vae_runtime_constants(src.config("vae")), "denoiser": "transformer", "latent_multiple": PATCH,
            "patch_size": PATCH, "token_multiple": SEQ_MULTIPLE, "variant": variant,
            # ZImagePipeline's sigmas; it passes a mu its schedulers' configs ignore
            "schedule": {"sigmas": "linspace", "mu": "linear"}}


def build_random(configs: dict, out_dir, seed: int = 0) -> None:
    """Write a ZImagePipeline folder with random seeded weights from component configs (see the registry):
    a Qwen2-kind tokenizer trained offline with Qwen3's chat template, Qwen3 at the configs' widths."""
    import tempfile
    from pathlib import Path

    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

    from export.offline_tokenizers import write_qwen_tokenizer
    from export.random_weights import build_modules, save_pipeline

    template = (Path(__file__).parent.parent / "templates" / "qwen3_chat_template.jinja").read_text()
    with tempfile.TemporaryDirectory() as tmp:
        vocab = write_qwen_tokenizer(Path(tmp, "tokenizer"), configs["vocab_pieces"], template, seed)
        tokenizer = AutoTokenizer.from_pretrained(Path(tmp, "tokenizer"))
        qwen = Qwen3Config(**{"vocab_size": vocab, **configs["text_encoder"]})
        dtype = configs.get("weights_dtype")
        modules = build_modules({
            "transformer": lambda: ZImageTransformer2DModel(**configs["transformer"]),
            "vae": lambda: AutoencoderKL(**configs["vae"]),
            "text_encoder": lambda: Qwen3Model(qwen),
        }, seed, streamed=dtype is not None)
        save_pipeline(configs.get("pipeline_class", "ZImagePipeline"), modules,
                      {"scheduler": FlowMatchEulerDiscreteScheduler(**configs["scheduler"]), "tokenizer": tokenizer},
                      out_dir, dtype, seed, configs.get("weights_for"))


FAMILY = Family(
    name="z_image",
    pipeline_classes=("ZImagePipeline", "ZImageImg2ImgPipeline", "ZImageInpaintPipeline"),
    submodules=(
        llm_encoder("text_encoder", TEXT_LAYERS),
        *transformer_specs(TRANSFORMER, HIDDEN),
        VAE_DECODER,
        VAE_ENCODER,
    ),
    constants=_constants,
    runtime_constants=_runtime_constants,
    derived_dims={**VAE_DIMS, "hidden_tokens": _hidden_tokens},
    tokenizers=("tokenizer",),
    build_random=build_random,
    tiny_vae="taef1",
    # ZImagePipeline: the chat template with thinking on; each prompt's own tokens are read (padding: longest)
    prompt_formats={"tokenizer": PromptFormat(chat={"enable_thinking": True}, padding="longest")},
)
