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

import functools
from typing import NamedTuple

import torch

from export.families.first_block import block_residuals, transformer_specs, with_block_residuals
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


def rotated(x, freqs):
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
            q, k = rotated(q, freqs_cis), rotated(k, freqs_cis)
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


class Streams(NamedTuple):
    """What the transformer's (and its ControlNets') blocks read, in padded tensors: the embedded image
    tokens and captions with their rotary tables (B, S, D / 2, 2), the captions' key mask, the timestep's
    embedding; `n_image` real image tokens of `image_slots`."""

    x: torch.Tensor
    x_freqs: torch.Tensor
    cap: torch.Tensor
    cap_mask: torch.Tensor
    cap_freqs: torch.Tensor
    adaln: torch.Tensor
    n_image: int
    image_slots: int


class PaddedStreams(torch.nn.Module):
    """diffusers' Z-Image embedding of a batch, in padded tensors and real arithmetic, for a wrapper whose
    attribute `module_name` holds a module with the transformer's embedders and refiners (the transformer,
    or a ControlNet that borrows them: diffusers' `from_transformer`)."""

    def __init__(self, module_name: str, model):
        super().__init__()
        from diffusers.models.attention_processor import Attention

        setattr(self, module_name, model)
        self.module_name = module_name
        for module in model.modules():
            if isinstance(module, Attention):
                module.processor = _RealRopeAttention()
        rope = model.rope_embedder
        for i, (cos, sin) in enumerate(_real_rope_tables(rope.axes_dims, rope.axes_lens, rope.theta)):
            self.register_buffer(f"cos{i}", cos, persistent=False)
            self.register_buffer(f"sin{i}", sin, persistent=False)

    def _freqs(self, *positions):
        cos = torch.cat([getattr(self, f"cos{i}")[p] for i, p in enumerate(positions)], dim=-1)
        sin = torch.cat([getattr(self, f"sin{i}")[p] for i, p in enumerate(positions)], dim=-1)
        return torch.stack([cos, sin], dim=-1)

    def streams(self, latent, timestep, caption, caption_lengths) -> Streams:
        m = getattr(self, self.module_name)
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
        x = m.all_x_embedder[f"{PATCH}-1"](patches(latent))
        x = torch.cat([x, m.x_pad_token.expand(batch, image_slots - n_image, -1).to(x.dtype)], dim=1)
        pad = torch.zeros(image_slots - n_image, dtype=torch.int64, device=latent.device)
        # (no `j % cols`: onnxscript cannot translate a remainder by a symbolic size)
        row = torch.cat([torch.arange(rows, device=latent.device)[:, None].expand(rows, cols).reshape(n_image), pad])
        col = torch.cat([torch.arange(cols, device=latent.device)[None, :].expand(rows, cols).reshape(n_image), pad])
        real = torch.arange(image_slots, device=latent.device) < n_image
        first = torch.where(real[None], padded_lengths[:, None] + 1, 0)
        x_freqs = self._freqs(first, row.expand(batch, -1), col.expand(batch, -1))
        return Streams(x, x_freqs, cap, cap_mask, cap_freqs, adaln, n_image, image_slots)

    def refined_caption(self, s: Streams) -> torch.Tensor:
        cap = s.cap
        for layer in getattr(self, self.module_name).context_refiner:
            cap = layer(cap, _additive(s.cap_mask, cap.dtype), s.cap_freqs)
        return cap

    @staticmethod
    def joint_mask(s: Streams) -> torch.Tensor:
        """The additive key mask of the blocks' stream (the image's tokens, then the caption's)."""
        image = torch.ones(s.cap_mask.shape[0], s.image_slots, dtype=torch.bool, device=s.cap_mask.device)
        return _additive(torch.cat([image, s.cap_mask], 1), s.x.dtype)


def patches(latent):
    """(B, C, H, W) -> (B, H/2 * W/2, 2 * 2 * C): 2x2 patches in diffusers' order (row, column, channel)."""
    batch, channels, height, width = latent.shape
    x = latent.reshape(batch, channels, height // PATCH, PATCH, width // PATCH, PATCH).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(batch, (height // PATCH) * (width // PATCH), PATCH * PATCH * channels)


class _PaddedForward(PaddedStreams):
    """(latent (B, C, H, W), timestep (B,) as the pipeline passes it, caption (B, L, width) right-padded,
    caption_lengths (B,), then a ControlNet residual per layer of `places`) -> the transformer's output
    (B, C, H, W): diffusers' forward on [latent[i][:, None]] and [caption[i, :caption_lengths[i]]], stacked,
    its `controlnet_block_samples` {place: residual} added after those layers."""

    def __init__(self, model, places: tuple[int, ...] = ()):
        super().__init__("transformer", model)
        self.places = places

    def forward(self, latent, timestep, caption, caption_lengths, *residuals):
        m, s = self.transformer, self.streams(latent, timestep, caption, caption_lengths)
        x = s.x
        for layer in m.noise_refiner:
            x = layer(x, None, s.x_freqs, s.adaln)
        joint = torch.cat([x, self.refined_caption(s)], dim=1)
        joint_freqs, joint_mask = torch.cat([s.x_freqs, s.cap_freqs], dim=1), self.joint_mask(s)
        added = dict(zip(self.places, residuals))
        for i, layer in enumerate(m.layers):
            joint = layer(joint, joint_mask, joint_freqs, s.adaln)
            if i in added:
                joint = joint + added[i]
        joint = m.all_final_layer[f"{PATCH}-1"](joint, c=s.adaln)
        batch, channels, height, width = latent.shape
        out = joint[:, :s.n_image].reshape(batch, height // PATCH, width // PATCH, PATCH, PATCH, channels)
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


def controlled_transformer(src, configs: list[dict]) -> tuple[SubmoduleSpec]:
    """The transformer's description with a ControlNet residual input per layer after which the ControlNets
    `configs` add one (`block_residual_<layer>`: their control_layers_places), the union where several differ
    (export/families/controlnet_z_image.py); its first-block graph stays the base's (as SD3's)."""
    places = tuple(sorted({p for config in configs for p in config["control_layers_places"]}))
    return (with_block_residuals(TRANSFORMER, block_residuals(places, HIDDEN),
                                 functools.partial(_PaddedForward, places=places), HIDDEN),)


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
    pipeline_classes=("ZImagePipeline", "ZImageImg2ImgPipeline", "ZImageInpaintPipeline", "ZImageControlNetPipeline",
                      "ZImageControlNetInpaintPipeline"),
    submodules=(
        llm_encoder("text_encoder", TEXT_LAYERS),
        *transformer_specs(TRANSFORMER, HIDDEN, block_outputs=True),
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
