"""LTX-Video text and image to video (LTXPipeline, LTXImageToVideoPipeline), as data: T5 unmasked at the padded
length, the video transformer on packed tokens, and the VAE's decoder and (for the image condition) encoder.

- `text_encoder`: T5 without a mask, as the pipeline runs it: the padding's states are read (masked only in the
  transformer's cross-attention), so the encoder runs at the request's `max_sequence_length` (Flux's T5 graph).
- `transformer`: diffusers' LTXVideoTransformer3DModel on packed latents (N, F*h*w, C) with a timestep per token
  (image to video keeps the first latent frame at 0) and its rotary positions as `video_coords` (N, 3, tokens):
  the pipeline's frame, row and column of each token times (8 / frame_rate, 32, 32). Given as coordinates, the
  graph takes any frame count, size and frame rate; the integer sizes diffusers also accepts would be traced
  into constants.
- `vae_decoder`: the whole clip at once (N, C, F, h, w) -> frames (N, 3, 8(F - 1) + 1, 32h, 32w), with the decode
  timestep of a timestep-conditioned VAE (0.9.1 on). Its decoder is not causal: every output frame reads latent
  frames on both sides (about 20 deep), so the clip is not cut into chunks as Wan's causal decoder is.
- `vae_encoder`: an image (N, 3, H, W) -> the posterior (mean, log-variance) of its latent frame.
The per-channel statistics (`latents_mean`, `latents_std`, buffers in the VAE's weights, not its config) are
runtime constants: the runner (de)normalises, and mixes the decode noise in between as the pipeline does.
"""
from __future__ import annotations

import functools

import torch

from export.families import parts
from export.families.first_block import inner_dim, transformer_specs
from export.spec import Family, PromptFormat, SubmoduleSpec, TensorSpec as T

MAX_TEXT = 128  # LTXPipeline's max_sequence_length default


def _per_head(heads: int, mask, target_length: int, batch_size: int):
    """The cross-attention's mask bias (N, 1, L) once per head, (N * heads, 1, L): what diffusers'
    `prepare_attention_mask` returns, by expanding rather than `repeat_interleave`, whose output size the tracer
    takes as a new symbol (the attention then cannot prove the mask's shape)."""
    _, rows, length = mask.shape
    return mask[:, None].expand(batch_size, heads, rows, length).reshape(batch_size * heads, rows, length)


class _Transformer(torch.nn.Module):
    """LTXVideoTransformer3DModel as the pipelines call it, its positions given as coordinates."""

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer
        for module in transformer.modules():
            if type(module).__name__ == "LTXAttention":
                module.prepare_attention_mask = functools.partial(_per_head, module.heads)

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask, timestep, video_coords):
        return self.transformer(hidden_states, encoder_hidden_states, timestep, encoder_attention_mask,
                                video_coords=video_coords, return_dict=False)


def _check_decoder(vae) -> None:
    if any(vae.config.decoder_inject_noise):
        raise ValueError("this LTX-Video VAE's decoder adds noise from torch's global random state inside its blocks "
                         "(decoder_inject_noise, LTX-Video 0.9.1), which no graph input can reproduce: export "
                         "LTX-Video 0.9.0 or 0.9.5 and later, whose decoders draw none")


class _Decoder(torch.nn.Module):
    """Denormalised latents (N, C, F, h, w) and the decode timestep -> frames (N, 3, F', H, W) around [-1, 1]."""

    def __init__(self, vae):
        super().__init__()
        _check_decoder(vae)
        self.vae = vae

    def forward(self, latent, timestep):
        conditioned = self.vae.config.timestep_conditioning
        return (self.vae.decode(latent, timestep if conditioned else None, return_dict=False)[0],)


class _Encoder(torch.nn.Module):
    """An image (N, 3, H, W) in [-1, 1] -> its one-frame clip's posterior (mean, log-variance), (N, C, h, w)."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, image):
        posterior = self.vae.encode(image[:, :, None]).latent_dist
        return posterior.mean[:, :, 0], posterior.logvar[:, :, 0]


_LATENT = ("batch", "latent_channels", "latent_height", "latent_width")
_VIDEO_LATENT = ("batch", "latent_channels", "latent_frames", "latent_height", "latent_width")
HIDDEN = ("batch", "video_tokens", "inner_dim")
TRANSFORMER = SubmoduleSpec(
    name="transformer",
    component="transformer",
    inputs=(
        T("hidden_states", "float32", ("batch", "video_tokens", "latent_channels")),
        T("encoder_hidden_states", "float32", ("batch", "text_length", "t5_width")),
        T("encoder_attention_mask", "int64", ("batch", "text_length"), mask=True),
        T("timestep", "float32", ("batch", "video_tokens"), high=1000),
        T("video_coords", "float32", ("batch", 3, "video_tokens"), high=64),
    ),
    outputs=(T("noise_pred", "float32", ("batch", "video_tokens", "latent_channels")),),
    wrap=_Transformer,
    latent_divisor=1,
    quantization={"denoiser": True, "keep_scopes": ("proj_in", "time_embed", "caption_projection", "proj_out"),
                  "fp32_scopes": ("time_embed",), "fp32_inputs": ("timestep", "video_coords")},
)
VAE_DECODER = SubmoduleSpec(
    name="vae_decoder", component="vae",
    inputs=(T("latent", "float32", _VIDEO_LATENT), T("timestep", "float32", ("batch",), high=1)),
    outputs=(T("frames", "float32", ("batch", 3, "video_frames", "image_height", "image_width")),),
    wrap=_Decoder, latent_divisor=1,
    # most of an OpenVINO run's time once the transformer is int8: int8 activations too (parts.VAE_DECODER's)
    quantization={"activations": True})
VAE_ENCODER = SubmoduleSpec(
    name="vae_encoder", component="vae",
    inputs=(T("image", "float32", ("batch", 3, "image_height", "image_width")),),
    outputs=(T("latent_mean", "float32", _LATENT), T("latent_logvar", "float32", _LATENT)),
    wrap=_Encoder, latent_divisor=1)


def _video_tokens(dims: dict[str, int]) -> int:
    return dims["latent_frames"] * dims["latent_height"] * dims["latent_width"]


def _compression(vae: dict) -> tuple[int, int]:
    """(spatial, temporal) compression, as AutoencoderKLLTXVideo computes them where its config does not say."""
    scaled = sum(vae.get("spatio_temporal_scaling", (True, True, True, False)))
    return (vae.get("spatial_compression_ratio") or vae.get("patch_size", 4) * 2 ** scaled,
            vae.get("temporal_compression_ratio") or vae.get("patch_size_t", 1) * 2 ** scaled)


def _constants(src) -> dict[str, int]:
    tr, vae = src.config("transformer"), src.config("vae")
    if tr.get("patch_size", 1) != 1 or tr.get("patch_size_t", 1) != 1:
        raise ValueError(f"LTX-Video transformers with patches larger than one latent pixel are not supported "
                         f"(this one's patch_size {tr.get('patch_size')}, patch_size_t {tr.get('patch_size_t')})")
    spatial, temporal = _compression(vae)
    return {
        **parts.t5_constants(src.config("text_encoder")),
        "latent_channels": vae.get("latent_channels", 128),
        "in_channels": tr["in_channels"],
        "vae_scale_factor": spatial,
        "vae_temporal_scale": temporal,
        "frames_offset": 1 - temporal,
        "latent_multiple": 1,
        "inner_dim": inner_dim(tr),
        "num_train_timesteps": src.config("scheduler")["num_train_timesteps"],
    }


def _statistics(src) -> dict[str, list[float]]:
    """The VAE's latents_mean and latents_std: buffers of its checkpoint, read alone (the real VAE is 5 GB)."""
    from safetensors import safe_open

    from export.lazy_weights import checkpoint_index

    index = checkpoint_index(src.folder / "vae")
    stats = {}
    for name in ("latents_mean", "latents_std"):
        with safe_open(index[name]["file"], "pt") as f:
            stats[name] = f.get_tensor(name).float().tolist()
    return stats


def _runtime_constants(src) -> dict:
    constants = _constants(src)
    return {
        **parts.video_defaults(src.entry, 512, 704, 161),  # LTXPipeline's size and frames
        "vae_scaling_factor": src.config("vae").get("scaling_factor", 1.0), "vae_shift_factor": 0.0,
        **_statistics(src),
        "vae_timestep_conditioning": bool(src.config("vae").get("timestep_conditioning", False)),
        "vae_scale_factor": constants["vae_scale_factor"],
        "vae_temporal_scale": constants["vae_temporal_scale"],
        "denoiser": "transformer",
        "latent_multiple": 1,
        "patch_size": 1,
        "max_text": MAX_TEXT,
        "fps": 25,  # LTXPipeline's frame_rate default, which the model card's export_to_video(..., fps=24) rounds
        "schedule": {"sigmas": "linspace", "mu": "linear"},  # LTXPipeline: 1 to 1/n, shifted by its tokens
    }


def build_random(configs: dict, out_dir, seed: int = 0) -> None:
    """Write an LTXPipeline folder with random seeded weights from component configs (see the registry): a T5
    SentencePiece tokenizer trained offline, T5's encoder, the transformer and the VAE at the configs' widths (its
    per-channel statistics drawn too: they are weights, not config), and the flow-matching Euler scheduler."""
    import tempfile
    from pathlib import Path

    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXVideoTransformer3DModel
    from transformers import AutoTokenizer, T5Config, T5EncoderModel

    from export.offline_tokenizers import write_t5_tokenizer
    from export.random_weights import build_modules, save_pipeline

    def vae():
        module = AutoencoderKLLTXVideo(**configs["vae"])
        generator = torch.Generator().manual_seed(seed)
        channels = module.latents_mean.shape[0]
        module.latents_mean.copy_(0.2 * torch.randn(channels, generator=generator))
        module.latents_std.copy_(0.5 + torch.rand(channels, generator=generator))
        return module

    with tempfile.TemporaryDirectory() as tmp:
        vocab = write_t5_tokenizer(Path(tmp, "tokenizer"), configs["t5_vocab_pieces"], seed)
        tokenizer = AutoTokenizer.from_pretrained(Path(tmp, "tokenizer"))
        t5 = T5Config(vocab_size=configs.get("t5_vocab_size", vocab), **configs["text_encoder"])
        modules = build_modules({
            "transformer": lambda: LTXVideoTransformer3DModel(**configs["transformer"]),
            "vae": vae,
            "text_encoder": lambda: T5EncoderModel(t5),
        }, seed, streamed=configs.get("weights_dtype") is not None)
        save_pipeline("LTXPipeline", modules, {"scheduler": FlowMatchEulerDiscreteScheduler(**configs["scheduler"]),
                                               "tokenizer": tokenizer}, out_dir, configs.get("weights_dtype"), seed,
                      configs.get("weights_for"))


FAMILY = Family(
    name="ltx",
    pipeline_classes=("LTXPipeline", "LTXImageToVideoPipeline"),
    submodules=(parts.t5_encoder("text_encoder"), *transformer_specs(TRANSFORMER, HIDDEN), VAE_DECODER, VAE_ENCODER),
    constants=_constants,
    runtime_constants=_runtime_constants,
    derived_dims={**parts.VAE_DIMS, "video_tokens": _video_tokens,
                  "video_frames": ("latent_frames", "vae_temporal_scale", "frames_offset")},
    tokenizers=("tokenizer",),
    build_random=build_random,
    # LTXPipeline: no template; padded to max_sequence_length, the padding's states read (T5 runs unmasked)
    prompt_formats={"tokenizer": PromptFormat(template="{}", padding="max_length")},
)
