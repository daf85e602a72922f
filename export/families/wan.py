"""Wan 2.1 text to video (WanPipeline), as data: UMT5 with a mask, the video transformer, and the causal 3D VAE as
chunk graphs whose feature cache is explicit state.

diffusers' AutoencoderKLWan decodes one latent frame at a time and encodes the first video frame, then 4 at a time:
each causal convolution keeps the last two frames of its input in a Python list (`feat_cache`) for the next call,
and the temporal resamplers skip their convolution on the first chunk. One graph over the whole clip would bake its
length in or hold every frame's activations; here the cache is a tensor the graphs take and return, so the runner
loops over the chunks and memory follows the chunk, not the clip:
- `vae_decoder_first`: the first latent frame -> the first video frame and the cache;
- `vae_decoder`: a later latent frame and the cache -> its 4 video frames and the next cache;
- `vae_encoder_first`, `vae_encoder`: the same for the encoder (the first frame, then 4 at a time -> a latent
  frame's posterior, normalised as the pipelines normalise it).
Each runs diffusers' own decoder or encoder with the list given: a slot diffusers has not filled yet is zeros of two
frames (its causal padding), so the same code is exact from the second chunk on. The slots (channels, spatial
scale) are read from the VAE itself on the meta device and packed into one tensor (batch, channels, h, w) at the
latent's sides: each slot (batch, c, 2, h * s, w * s) reshaped, not moved. The graphs hold the per-channel
(de)normalisation.
"""
from __future__ import annotations

import dataclasses
import functools
import json

import torch

from export.families import parts
from export.families.first_block import inner_dim, transformer_specs
from export.families.qwen_image import statistics
from export.spec import Family, PromptFormat, SubmoduleSpec, TensorSpec as T

CACHE_FRAMES = 2  # diffusers' CACHE_T: the frames a causal convolution keeps of its input
MAX_TEXT = 512  # WanPipeline's max_sequence_length default: the transformer reads that many states


class _Transformer(torch.nn.Module):
    """WanTransformer3DModel as the pipeline calls it. Its rotary tables are float64 buffers, which would make
    the graph's rotary arithmetic double: they are taken as float32, as every other tensor of the graph is."""

    def __init__(self, transformer):
        super().__init__()
        for name in ("freqs_cos", "freqs_sin"):
            setattr(transformer.rope, name, getattr(transformer.rope, name).float())
        self.transformer = transformer

    def forward(self, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image=None):
        return self.transformer(hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image,
                                return_dict=False)


class _ImageEncoder(torch.nn.Module):
    """CLIPVisionModel as WanImageToVideoPipeline reads it: the penultimate layer's hidden states. Its last layer,
    whose output the pipeline throws away, is left out."""

    def __init__(self, clip):
        super().__init__()
        clip.encoder.layers = clip.encoder.layers[:-1]
        self.clip = clip

    def forward(self, pixel_values):
        return (self.clip(pixel_values).last_hidden_state,)


IMAGE_ENCODER = SubmoduleSpec(
    name="image_encoder",
    component="image_encoder",
    inputs=(T("pixel_values", "float32", ("batch", 3, "clip_image_size", "clip_image_size")),),
    outputs=(T("image_embeds", "float32", ("batch", "clip_image_tokens", "clip_image_width")),),
    wrap=_ImageEncoder,
)


@functools.lru_cache(maxsize=16)
def _cache_slots(vae_config: str, part: str) -> tuple[tuple[int, int] | None, ...]:
    """(channels, scale against the latent's side) of each of the `part`'s ("decoder", "encoder") cache slots, in
    its order (None: a slot it never fills), as its own code fills them over two chunks on the meta device."""
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        vae = AutoencoderKLWan.from_config(json.loads(vae_config))
        cache = [None] * vae._cached_conv_counts[part]
        if part == "decoder":
            for first in (True, False):
                vae.decoder(torch.zeros(1, vae.config.z_dim, 1, 2, 2), feat_cache=cache, feat_idx=[0],
                            first_chunk=first)
        else:  # on the patches' channels (Wan 2.2's VAE) where the VAE patchifies its input
            side = 2 * 2 ** len(vae.config.temperal_downsample)
            for frames in (1, 2 ** sum(vae.config.temperal_downsample)):
                vae.encoder(torch.zeros(1, vae.config.in_channels, frames, side, side), feat_cache=cache,
                            feat_idx=[0])
    return tuple(None if c is None else (c.shape[1], c.shape[3] // 2) for c in cache)


def cache_slots(vae_config: dict, part: str):
    return _cache_slots(json.dumps(dict(vae_config), sort_keys=True, default=str), part)


def cache_channels(vae_config: dict, part: str) -> int:
    return sum(c * CACHE_FRAMES * s * s for c, s in filter(None, cache_slots(vae_config, part)))


def spatial_scale(vae_config: dict) -> int:
    """Pixels a latent pixel spans: the encoder's down-samplings times the patch Wan 2.2's VAE first folds into
    channels (AutoencoderKLWan's patch_size; its scale_factor_spatial, which Wan 2.1's configs may lack)."""
    return 2 ** len(vae_config["temperal_downsample"]) * (vae_config.get("patch_size") or 1)


class _Chunk(torch.nn.Module):
    """One chunk of a clip through the VAE's `part` with its feature cache given and returned packed: `first`,
    the clip's first chunk, takes none."""

    part = ""

    def __init__(self, vae, first: bool):
        super().__init__()
        self.vae, self.first = vae, first
        self.slots = cache_slots(vae.config, self.part)
        for module in vae.modules():  # see qwen_image's _one_frame: the same pixels, one Resize
            if type(module).__name__ == "WanUpsample" and module.mode == "nearest-exact":
                module.mode = "nearest"

    def unpacked(self, cache, b: int, h: int, w: int) -> list:
        """The cache as the diffusers code's list; a slot (b, c, 2, h * s, w * s) of the latent's sides h, w."""
        slots, at = [], 0
        for slot in self.slots:
            if slot is None or self.first:
                slots.append(None)
                continue
            c, s = slot
            slots.append(cache[:, at:at + c * CACHE_FRAMES * s * s].reshape(b, c, CACHE_FRAMES, h * s, w * s))
            at += c * CACHE_FRAMES * s * s
        return slots

    def packed(self, slots: list, like, b: int, h: int, w: int):
        """The list the diffusers code left, as one tensor: a slot it marked "Rep" (a temporal upsampler's first
        chunk, which pads its next with zeros) zeros, a slot of one frame (the first chunk's) after a zero frame
        (the causal padding before it)."""
        packed = []
        for kept, slot in zip(slots, self.slots):
            if slot is None:
                continue
            c, s = slot
            if isinstance(kept, str):
                kept = like.new_zeros(b, c, CACHE_FRAMES, h * s, w * s)
            elif kept.shape[2] < CACHE_FRAMES:
                kept = torch.cat([torch.zeros_like(kept), kept], dim=2)
            packed.append(kept.reshape(b, c * CACHE_FRAMES * s * s, h, w))
        return torch.cat(packed, dim=1)


class _DecoderChunk(_Chunk):
    """One latent frame (N, z, h, w) of the pipeline's latents -> its video frames in [-1, 1] and the next cache."""

    part = "decoder"

    def forward(self, latent, cache=None):
        b, _, h, w = latent.shape
        slots = self.unpacked(cache, b, h, w)
        mean, std = (s.to(self.vae.post_quant_conv.weight.dtype) for s in statistics(self.vae))
        z = latent / (1.0 / std) + mean  # diffusers: latents / (1 / std) + mean
        x = self.vae.post_quant_conv(z[:, :, None])
        frames = self.vae.decoder(x, feat_cache=slots, feat_idx=[0], first_chunk=self.first)
        if self.vae.config.patch_size is not None:  # Wan 2.2's VAE: its output channels are patches
            from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

            frames = unpatchify(frames, self.vae.config.patch_size)
        return frames.clamp(-1.0, 1.0), self.packed(slots, latent, b, h, w)


class _EncoderChunk(_Chunk):
    """Video frames in [-1, 1] (N, 3, frames, H, W: the clip's first alone, then 4 at a time) -> the posterior of
    their latent frame (mean, log-variance) in the pipeline's latent space, and the next cache."""

    part = "encoder"

    def forward(self, frames, cache=None):
        from diffusers.models.autoencoders.autoencoder_kl_wan import patchify
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        b, scale = frames.shape[0], spatial_scale(self.vae.config)
        h, w = frames.shape[3] // scale, frames.shape[4] // scale
        slots = self.unpacked(cache, b, h, w)
        x = frames if self.vae.config.patch_size is None else patchify(frames, self.vae.config.patch_size)
        out = self.vae.quant_conv(self.vae.encoder(x, feat_cache=slots, feat_idx=[0]))
        posterior = DiagonalGaussianDistribution(out)
        mean, std = (s.to(self.vae.post_quant_conv.weight.dtype) for s in statistics(self.vae))
        inverse = 1.0 / std  # diffusers: (latents - mean) * (1 / std)
        return ((posterior.mean[:, :, 0] - mean) * inverse, posterior.logvar[:, :, 0] + 2 * torch.log(inverse),
                self.packed(slots, frames, b, h, w))


_LATENT = ("batch", "latent_channels", "latent_height", "latent_width")


def _video(frames) -> tuple:
    return ("batch", 3, frames, "image_height", "image_width")


def _chunk(name: str, wrap, first: bool, inputs: tuple, outputs: tuple) -> SubmoduleSpec:
    """A chunk graph of the VAE: `inputs` and the cache (but the first chunk's) -> `outputs` and the next cache.
    The decoder's take int8 activations where a target quantizes whole submodules (parts.VAE_DECODER's): once the
    transformer is int8, most of a run's time is theirs."""
    cache = ("batch", f"{wrap.part}_cache_channels", "latent_height", "latent_width")
    return SubmoduleSpec(
        name=name, component="vae", inputs=inputs + (() if first else (T("cache", "float32", cache),)),
        outputs=outputs + (T("next_cache", "float32", cache),), wrap=functools.partial(wrap, first=first),
        latent_divisor=1, quantization={"activations": True} if wrap.part == "decoder" else {})


_POSTERIOR = (T("latent_mean", "float32", _LATENT), T("latent_logvar", "float32", _LATENT))
VAE_CHUNKS = (
    _chunk("vae_decoder_first", _DecoderChunk, True, (T("latent", "float32", _LATENT),),
           (T("frames", "float32", _video(1)),)),
    _chunk("vae_decoder", _DecoderChunk, False, (T("latent", "float32", _LATENT),),
           (T("frames", "float32", _video("vae_temporal_scale")),)),
    _chunk("vae_encoder_first", _EncoderChunk, True, (T("frames", "float32", _video(1)),), _POSTERIOR),
    _chunk("vae_encoder", _EncoderChunk, False, (T("frames", "float32", _video("vae_temporal_scale")),), _POSTERIOR),
)
_VIDEO_LATENT = ("batch", "latent_channels", "latent_frames", "latent_height", "latent_width")
# the transformer's input: the latents, and Wan 2.1 I2V's (and Wan 2.2 I2V's) image mask and latents as channels
_TRANSFORMER_INPUT = ("batch", "in_channels", "latent_frames", "latent_height", "latent_width")
HIDDEN = ("batch", "video_tokens", "inner_dim")  # the blocks' stream: a token per 1 x 2 x 2 patch of the latents


def expands_timesteps(src) -> bool:
    """Wan 2.2 TI2V-5B's pipeline flag: the transformer takes a timestep per token (0 on an image's first frame)."""
    return bool(src.model_index().get("expand_timesteps"))


def takes_image_embeds(src) -> bool:
    """Wan 2.1 I2V's transformer: it reads the CLIP image encoder's states beside the prompt's."""
    return src.config("transformer").get("image_dim") is not None


def _transformer(per_token: bool, image: bool = False) -> SubmoduleSpec:
    return SubmoduleSpec(
        name="transformer",
        component="transformer",
        inputs=(
            T("hidden_states", "float32", _TRANSFORMER_INPUT),
            T("timestep", "float32", ("batch", "video_tokens") if per_token else ("batch",), high=1000),
            # Wan 2.1 I2V's attention splits the image's states from the prompt's at 512 from the end: its prompt
            # states are always max_text (512) long
            T("encoder_hidden_states", "float32", ("batch", "max_text" if image else "text_length", "t5_width")),
            *((T("encoder_hidden_states_image", "float32", ("batch", "clip_image_tokens", "clip_image_width")),)
              if image else ()),
        ),
        outputs=(T("noise_pred", "float32", _VIDEO_LATENT),),
        wrap=_Transformer,
        latent_divisor="latent_multiple",
        quantization={"denoiser": True, "keep_scopes": ("patch_embedding", "condition_embedder", "proj_out"),
                      "fp32_scopes": ("condition_embedder",), "fp32_inputs": ("timestep",)},
        when=lambda src: expands_timesteps(src) == per_token and takes_image_embeds(src) == image,
    )


TRANSFORMER = _transformer(per_token=False)
_TRANSFORMER_GRAPHS = transformer_specs(TRANSFORMER, HIDDEN)  # and its first-block graph


# Wan 2.2 A14B's low-noise transformer, which takes over below the boundary step: the same graphs of its own weights
# (its first-block graph for a First-Block Cache of its own, as diffusers' hooks on each transformer)
TRANSFORMER_2 = tuple(dataclasses.replace(spec, name=spec.name.replace("transformer", "transformer_2", 1),
                                          component="transformer_2") for spec in _TRANSFORMER_GRAPHS)


def _video_tokens(dims: dict[str, int]) -> int:
    return dims["latent_frames"] * (dims["latent_height"] // 2) * (dims["latent_width"] // 2)


def _constants(src) -> dict[str, int]:
    tr, vae = src.config("transformer"), src.config("vae")
    _, patch_h, patch_w = tr["patch_size"]
    assert patch_h == patch_w, tr["patch_size"]
    return {
        **parts.t5_constants(src.config("text_encoder")),
        "latent_channels": vae["z_dim"],
        "in_channels": tr["in_channels"],
        "vae_scale_factor": spatial_scale(vae),
        "vae_temporal_scale": 2 ** sum(vae["temperal_downsample"]),
        "latent_multiple": patch_h,
        "inner_dim": inner_dim(tr),
        **{f"{part}_cache_channels": cache_channels(vae, part) for part in ("decoder", "encoder")},
        "num_train_timesteps": src.config("scheduler")["num_train_timesteps"],
        **(_clip_constants(src.config("image_encoder")) if src.has("image_encoder") else {}),
        "max_text": MAX_TEXT,
    }


def _clip_constants(config: dict) -> dict[str, int]:
    """CLIP's vision tower: its image side, its tokens (a patch each, and the class token) and its width."""
    return {"clip_image_size": config["image_size"], "clip_image_width": config["hidden_size"],
            "clip_image_tokens": (config["image_size"] // config["patch_size"]) ** 2 + 1}


def _image_processor(src) -> dict:
    """WanImageToVideoPipeline's CLIPImageProcessor settings (its preprocessor_config.json), which the runner
    applies without transformers (runners/conditioning/clip_images.py)."""
    config = json.loads((src.folder / "image_processor" / "preprocessor_config.json").read_text())
    return {k: config[k] for k in ("size", "crop_size", "image_mean", "image_std", "resample", "rescale_factor")}


def _runtime_constants(src) -> dict:
    constants = _constants(src)
    return {
        **parts.video_defaults(src.entry, 480, 832, 81),  # WanPipeline's size and frames
        "vae_scaling_factor": 1.0, "vae_shift_factor": 0.0,  # the graphs denormalise (the config's mean and std)
        "vae_scale_factor": constants["vae_scale_factor"],
        "vae_temporal_scale": constants["vae_temporal_scale"],
        "denoiser": "transformer",
        "latent_multiple": constants["latent_multiple"],
        "patch_size": constants["latent_multiple"],
        "max_text": constants["max_text"],
        "fps": src.entry.extra.get("fps", 16),  # the model card's export_to_video(..., fps=16)
        # Wan 2.2 A14B: transformer_2 below boundary_ratio x the training timesteps (model_index.json's)
        **({"boundary_ratio": src.model_index()["boundary_ratio"]} if src.has("transformer_2") else {}),
        "expand_timesteps": expands_timesteps(src),
        # image to video with the image as channels (WanImageToVideoPipeline, not TI2V): the mask's 4 and the latents
        "condition_channels": constants["in_channels"] - constants["latent_channels"],
        **({"image_processor": _image_processor(src)} if src.has("image_encoder") else {}),
    }


def build_random(configs: dict, out_dir, seed: int = 0) -> None:
    """Write a WanPipeline folder (WanImageToVideoPipeline's where the image is channels) with random seeded weights
    from component configs (see the registry): a T5 SentencePiece tokenizer trained offline (UMT5's kind), UMT5's
    encoder, the transformer and the VAE at the configs' widths (Wan 2.1 I2V's CLIP vision tower and image processor
    too), and Wan's UniPC scheduler."""
    import tempfile
    from pathlib import Path

    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

    from export.offline_tokenizers import write_t5_tokenizer
    from export.random_weights import build_modules, save_pipeline

    with tempfile.TemporaryDirectory() as tmp:
        vocab = write_t5_tokenizer(Path(tmp, "tokenizer"), configs["t5_vocab_pieces"], seed)
        tokenizer = AutoTokenizer.from_pretrained(Path(tmp, "tokenizer"))
        umt5 = UMT5Config(vocab_size=configs.get("t5_vocab_size", vocab), **configs["text_encoder"])
        dtype = configs.get("weights_dtype")
        # Wan 2.2 A14B's second transformer seeded last: the other components are Wan 2.1's of the same configs
        # (Wan 2.1 I2V's image encoder likewise)
        second = {"transformer_2": lambda: WanTransformer3DModel(**configs["transformer_2"])} \
            if "transformer_2" in configs else {}
        flags = {k: configs[k] for k in ("boundary_ratio", "expand_timesteps") if k in configs}
        if "image_encoder" in configs:  # (transformers' CLIP image processor warns on import without torchvision)
            from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

            second["image_encoder"] = lambda: CLIPVisionModel(CLIPVisionConfig(**configs["image_encoder"]))
            flags["image_processor"] = CLIPImageProcessor(**configs["image_processor"])
        modules = build_modules({
            "transformer": lambda: WanTransformer3DModel(**configs["transformer"]),
            "vae": lambda: AutoencoderKLWan(**configs["vae"]),
            "text_encoder": lambda: UMT5EncoderModel(umt5), **second,
        }, seed, streamed=dtype is not None)
        # image to video where the transformer reads the image as channels (Wan 2.1 I2V, Wan 2.2 I2V A14B)
        channels = configs["transformer"]["in_channels"] > configs["transformer"]["out_channels"]
        save_pipeline("WanImageToVideoPipeline" if channels else "WanPipeline", modules,
                      {"scheduler": UniPCMultistepScheduler(**configs["scheduler"]), "tokenizer": tokenizer, **flags},
                      out_dir, dtype, seed, configs.get("weights_for"))


FAMILY = Family(
    name="wan",
    pipeline_classes=("WanPipeline", "WanImageToVideoPipeline"),
    submodules=(parts.masked_t5_encoder("text_encoder"), *_TRANSFORMER_GRAPHS,
                *transformer_specs(_transformer(per_token=True), HIDDEN),
                *transformer_specs(_transformer(per_token=False, image=True), HIDDEN), *TRANSFORMER_2, IMAGE_ENCODER,
                *VAE_CHUNKS),
    constants=_constants,
    runtime_constants=_runtime_constants,
    derived_dims={**parts.VAE_DIMS, "video_tokens": _video_tokens},
    tokenizers=("tokenizer",),
    build_random=build_random,
    # WanPipeline: no template; the states past each prompt's tokens are zeroed, so the encoder runs on the call's
    # longest prompt and the runner pads with zeros to max_sequence_length
    prompt_formats={"tokenizer": PromptFormat(template="{}", padding="longest")},
)
