"""Qwen-Image (QwenImagePipeline, and its Img2Img and Inpaint pipelines): Qwen2.5-VL's language model read at its
last hidden states through the pipeline's own prompt template, the Qwen-Image MMDiT and its causal 3D VAE run on
one frame, as data.

The transformer's forward takes `img_shapes` (Python tuples) and builds a complex rotary table from them (3 axes:
frame, row and column, the rows and columns centred on 0; the text's positions after the image's largest half
side, on every axis). Its graph takes those positions as inputs instead (`img_ids`, `txt_ids`, as FLUX.1's), and
rotates in real arithmetic, so one graph serves every size; the text's key mask is an input too (captions padded
to the call's longest). The VAE is a causal 3D one that diffusers runs frame by frame with a Python feature
cache; on one frame every causal convolution sees two frames of zero padding before the frame, so each is its
last temporal slice: a 2D convolution (a third of the 3D one's work), which is what the graphs hold. Its graphs
work in the pipeline's latent space: normalised by the VAE config's per-channel mean and standard deviation.
"""
from __future__ import annotations

import dataclasses
import types

import torch

from export.families import parts
from export.families.first_block import block_residuals, transformer_specs, with_block_residuals
from export.families.llm_encoder import llm_constants, llm_encoder
from export.families.z_image import rotated
from export.spec import Family, PromptFormat, SubmoduleSpec, TensorSpec as T

PATCH = 2  # latents are packed in 2 x 2 patches
TEXT_LAYERS = (-1,)  # QwenImagePipeline reads hidden_states[-1]
# QwenImagePipeline's prompt_template_encode and prompt_template_encode_start_idx: the template's first 34 tokens
# (its system turn) are dropped from the states
PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")
DROP_TOKENS = 34
MAX_TEXT = 1024  # the pipeline's tokenizer_max_length: the states it keeps after the dropped tokens


def _angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """(..., S) positions -> (..., S, dim / 2, 2) cos and sin: diffusers' table rows (float32 products)."""
    angles = positions.float()[..., None] * inv_freq
    return torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1)


class _GivenRope(torch.nn.Module):
    """The transformer's pos_embed, given its tables: the forward's `img_shapes` argument carries them here
    (diffusers passes it to pos_embed and to nothing else on this path)."""

    def forward(self, tables, device=None, max_txt_seq_len=None):
        return tables


class _RealRopeAttention:
    """diffusers' QwenDoubleStreamAttnProcessor2_0 with the rotary embedding in real arithmetic and the
    text's key mask additive (one Add in the graph; every query sees the image's keys)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                 attention_mask=None, image_rotary_emb=None):
        head_dim = attn.inner_dim // attn.heads
        img = [p(hidden_states).unflatten(-1, (-1, head_dim)) for p in (attn.to_q, attn.to_k, attn.to_v)]
        txt = [p(encoder_hidden_states).unflatten(-1, (-1, head_dim))
               for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
        img[0], img[1] = attn.norm_q(img[0]), attn.norm_k(img[1])
        txt[0], txt[1] = attn.norm_added_q(txt[0]), attn.norm_added_k(txt[1])
        img_freqs, txt_freqs = image_rotary_emb
        img[0], img[1] = rotated(img[0], img_freqs), rotated(img[1], img_freqs)
        txt[0], txt[1] = rotated(txt[0], txt_freqs), rotated(txt[1], txt_freqs)
        q, k, v = (torch.cat([t, i], dim=1).transpose(1, 2) for t, i in zip(txt, img))
        mask = None
        if encoder_hidden_states_mask is not None:
            image = torch.ones(hidden_states.shape[:2], dtype=torch.bool, device=hidden_states.device)
            keys = torch.cat([encoder_hidden_states_mask, image], dim=1)
            mask = torch.where(keys, 0.0, torch.finfo(q.dtype).min).to(q.dtype)[:, None, None, :]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2, 3)
        seq_txt = encoder_hidden_states.shape[1]
        img_out = attn.to_out[0](out[:, seq_txt:].to(q.dtype))
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        return img_out, attn.to_add_out(out[:, :seq_txt].to(q.dtype))


class GivenPositions(torch.nn.Module):
    """A module with Qwen-Image's rotary embedding (the transformer, a ControlNet) held as `name`, its rotary
    positions given as ids: `img_ids` (image tokens, 3: frame, row, column) and `txt_ids` (text tokens, 3), both
    as diffusers' QwenEmbedRope numbers them; `tables` makes its tables from them, which the forward's
    `img_shapes` argument carries to the module's pos_embed."""

    def __init__(self, name: str, module):
        super().__init__()
        from diffusers.models.attention_processor import Attention

        setattr(self, name, module)
        rope = module.pos_embed
        for axis, dim in enumerate(rope.axes_dim):  # rope_params' inverse frequencies, in float32 as there
            inv_freq = 1.0 / torch.pow(rope.theta, torch.arange(0, dim, 2).to(torch.float32).div(dim))
            self.register_buffer(f"inv_freq{axis}", inv_freq, persistent=False)
        self.axes = len(rope.axes_dim)
        module.pos_embed = _GivenRope()
        for child in module.modules():
            if isinstance(child, Attention):
                child.processor = _RealRopeAttention()

    def _table(self, ids):
        """(S, 3) positions -> (1, S, head_dim / 2, 2), each axis's rows side by side, as diffusers' table; (N, S, 3)
        -> (N, S, head_dim / 2, 2), a table a sample."""
        table = torch.cat([_angles(ids[..., a], getattr(self, f"inv_freq{a}")) for a in range(self.axes)], dim=-2)
        return table if ids.dim() == 3 else table[None]

    def tables(self, img_ids, txt_ids):
        return self._table(img_ids), self._table(txt_ids)


class _Transformer(GivenPositions):
    """The transformer with its inputs as QwenImagePipeline feeds them (the timestep divided by 1000, the text's
    mask), its rotary positions as ids, and, exported beside ControlNets, a residual per block (`controlled`)."""

    def __init__(self, transformer):
        super().__init__("transformer", transformer)
        self.__dict__["modulation"] = None  # zero_cond_t: the call's modulate_index, for _zero_conditioned's hooks
        if getattr(transformer.config, "zero_cond_t", False):
            self.__dict__["modulation"] = {}
            _zero_conditioned(transformer, self.modulation)

    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, img_ids, txt_ids,
                *block_residuals):
        if self.modulation is not None:  # an Edit pipeline's input images' tokens are frames 1, 2, ...
            self.modulation["index"] = (img_ids[:, 0] > 0).long()[None].expand(hidden_states.shape[0], -1)
        # one residual per block: diffusers adds sample i // ceil(blocks / samples) after block i, here sample i
        out = self.transformer(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                               encoder_hidden_states_mask=encoder_hidden_states_mask, timestep=timestep,
                               img_shapes=self.tables(img_ids, txt_ids),
                               controlnet_block_samples=list(block_residuals) or None, return_dict=False)
        return (out[0],)


def _zero_conditioned(transformer, modulation: dict) -> None:
    """Qwen-Image-Edit-2511's transformer (zero_cond_t): the input images' tokens are modulated by the embedding
    of timestep 0, the image's by the step's. Its forward builds the per-token choice (`modulate_index`) from
    `img_shapes`' Python tuples; here the flags are off and hooks do what they do: the timestep embedded for
    [t, 0], each block given the choice (1 where a token's frame is an input image's, from `img_ids`), the text's
    modulation and the final norm given the step's half (sliced: diffusers' chunk of the doubled batch exports as
    a SplitToSequence that constant folding rejects)."""
    def doubled(module, args):
        return (torch.cat([args[0], args[0] * 0]), *args[1:])

    def indexed(module, args, kwargs):
        return args, {**kwargs, "modulate_index": modulation["index"]}

    def step_half(module, args):
        i = 1 if len(args) > 1 else 0  # norm_out(hidden, temb); txt_mod(temb)
        return (*args[:i], args[i][: args[i].shape[0] // 2], *args[i + 1:])

    transformer.zero_cond_t = False
    transformer.time_text_embed.register_forward_pre_hook(doubled)
    for block in transformer.transformer_blocks:
        block.zero_cond_t = False
        block.register_forward_pre_hook(indexed, with_kwargs=True)
        block.txt_mod.register_forward_pre_hook(step_half)
    transformer.norm_out.register_forward_pre_hook(step_half)


def _single_frame_conv(self, x, cache_x=None):
    """QwenImageCausalConv3d on one frame with no cache: its causal padding puts two zero frames before the
    frame, so only the kernel's last temporal slice meets it: a 2D convolution."""
    pad_w, _, pad_h, _, _, _ = self._padding
    out = torch.nn.functional.conv2d(x[:, :, 0], self.weight[:, :, -1], self.bias, stride=self.stride[1:],
                                     padding=(pad_h, pad_w))
    return out[:, :, None]


def _one_frame(vae):
    """The VAE as its graphs hold it: each causal convolution a 2D one (on one frame), each 2x "nearest-exact"
    upsampling a "nearest" one. At an integer scale both pick source pixel floor(i / 2); "nearest-exact" exports
    as index arithmetic (Range, GatherND) that fp16 conversion breaks, "nearest" as one Resize."""
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d, QwenImageUpsample

    for module in vae.modules():
        if isinstance(module, QwenImageCausalConv3d):
            module.forward = types.MethodType(_single_frame_conv, module)
        elif isinstance(module, QwenImageUpsample) and module.mode == "nearest-exact":
            assert all(float(f).is_integer() for f in module.scale_factor), module.scale_factor
            module.mode = "nearest"
    return vae


def statistics(vae, dtype=torch.float32):
    """The config's per-channel latent mean and standard deviation, (1, z, 1, 1), in `dtype` (the latents', as
    diffusers makes them: an fp16 decoder's convolutions take fp16)."""
    mean, std = (torch.tensor(vae.config[k], dtype=dtype).view(1, -1, 1, 1) for k in ("latents_mean", "latents_std"))
    return mean, std


class _Decoder(torch.nn.Module):
    """The pipeline's latents (N, z, h, w) -> image in [-1, 1]: denormalised, decoded as one frame."""

    def __init__(self, vae):
        super().__init__()
        self.vae = _one_frame(vae)

    def forward(self, latent):
        mean, std = statistics(self.vae, latent.dtype)
        # diffusers: latents / (1 / std) + mean
        z = latent / (1.0 / std) + mean
        return (self.vae.decode(z[:, :, None], return_dict=False)[0][:, :, 0],)


class _Encoder(torch.nn.Module):
    """Image in [-1, 1] -> the posterior (mean, log-variance) in the pipeline's latent space: normalised (a sample
    with unit noise in this space is one of diffusers' normalised samples)."""

    def __init__(self, vae):
        super().__init__()
        self.vae = _one_frame(vae)

    def forward(self, image):
        latent, logvar, mean, std = encoded(self.vae, image)
        inverse = 1.0 / std  # diffusers: (latents - mean) * (1 / std)
        return (latent - mean) * inverse, logvar + 2 * torch.log(inverse)


def encoded(vae, image):
    """The VAE's posterior of an image as one frame (its mean and log-variance) and the per-channel statistics."""
    posterior = vae.encode(image[:, :, None], return_dict=False)[0]
    return posterior.mean[:, :, 0], posterior.logvar[:, :, 0], *statistics(vae)


QUANTIZATION = {"denoiser": True, "keep_scopes": ("img_in", "txt_in", "txt_norm", "time_text_embed", "norm_out",
                                                  "transformer.proj_out"),
                "fp32_scopes": ("time_text_embed",), "fp32_inputs": ("timestep",)}
TRANSFORMER = SubmoduleSpec(
    name="transformer",
    component="transformer",
    inputs=(
        T("hidden_states", "float32", ("batch", "image_tokens", "packed_channels")),
        T("encoder_hidden_states", "float32", ("batch", "text_length", "text_width")),
        T("encoder_hidden_states_mask", "int64", ("batch", "text_length"), mask=True),
        T("timestep", "float32", ("batch",), high=1),
        # Example positions: up to 64 a side (1024 pixels); the image's are centred on 0 in the runner's
        T("img_ids", "float32", ("image_tokens", 3), high=64),
        T("txt_ids", "float32", ("text_length", 3), high=64),
    ),
    outputs=(T("noise_pred", "float32", ("batch", "image_tokens", "packed_channels")),),
    wrap=_Transformer,
    latent_divisor="latent_multiple",
    quantization=QUANTIZATION,
)
HIDDEN = ("batch", "image_tokens", "inner_dim")  # the blocks' image stream, which ControlNets add to


def controlled_transformer(src, configs: list[dict]) -> tuple[SubmoduleSpec]:
    """The transformer's description with a ControlNet residual input per block (block_residual_i, added after
    block i: export/families/controlnet_qwen_image.py); its first-block graph stays the base's."""
    residuals = block_residuals(range(src.config("transformer")["num_layers"]), HIDDEN)
    return (with_block_residuals(TRANSFORMER, residuals, TRANSFORMER.wrap, HIDDEN),)


VAE_DECODER = dataclasses.replace(parts.VAE_DECODER, wrap=_Decoder)
VAE_ENCODER = dataclasses.replace(parts.VAE_ENCODER, wrap=_Encoder)


def image_tokens(dims: dict[str, int]) -> int:
    return (dims["latent_height"] // PATCH) * (dims["latent_width"] // PATCH)


def scale(vae: dict) -> int:
    return 2 ** len(vae["temperal_downsample"])  # QwenImagePipeline's vae_scale_factor


def constants(src) -> dict[str, int]:
    tr, vae = src.config("transformer"), src.config("vae")
    return {
        **llm_constants(src.config("text_encoder"), TEXT_LAYERS),
        "latent_channels": vae["z_dim"],
        # a token holds a 2 x 2 patch of latent pixels; in_channels counts a pixel's, as for the other families
        "packed_channels": tr["in_channels"],
        "in_channels": tr["in_channels"] // PATCH**2,
        "vae_scale_factor": scale(vae),
        "latent_multiple": PATCH,
        "num_train_timesteps": src.config("scheduler")["num_train_timesteps"],
        "inner_dim": tr["num_attention_heads"] * tr["attention_head_dim"],
    }


def runtime_constants(src) -> dict:
    return {
        "vae_scaling_factor": 1.0, "vae_shift_factor": 0.0,  # the graphs normalise (the config's mean and std)
        "vae_scale_factor": scale(src.config("vae")),
        "denoiser": "transformer",
        "latent_multiple": PATCH,
        "patch_size": PATCH,
        # QwenImagePipeline's sigmas, shifted by the image's tokens (its scheduler's dynamic shifting)
        "schedule": {"sigmas": "linspace", "mu": "linear"},
        "max_text": MAX_TEXT,
    }


def vl_token_ids(tokenizer) -> dict[str, int]:
    """A Qwen VLM config's image, video and vision-boundary token ids, as `tokenizer` numbers them."""
    return {f"{name}_token_id": tokenizer.convert_tokens_to_ids(f"<|{token}|>") for name, token in
            (("image", "image_pad"), ("video", "video_pad"), ("vision_start", "vision_start"),
             ("vision_end", "vision_end"))}


def build_random(configs: dict, out_dir, seed: int = 0, prefix: str = PROMPT_TEMPLATE.split("{}")[0],
                 drop: int = DROP_TOKENS, later: tuple[str, ...] = ()) -> None:
    """Write a QwenImagePipeline folder with random seeded weights from component configs (see the registry):
    Qwen2.5-VL (its language model at the configs' widths, its vision tower beside it, which text to image
    loads and never runs) and a Qwen2-kind tokenizer trained offline with Qwen2.5-VL's chat template, whose
    vocabulary makes the template's `prefix` the `drop` tokens the pipeline drops. `later`: components the
    caller writes afterwards (the Edit pipelines' processor), None in the pipeline saved."""
    import tempfile
    from pathlib import Path

    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from export.offline_tokenizers import QWEN_VL_SPECIAL_TOKENS, write_qwen_tokenizer
    from export.random_weights import build_modules, save_pipeline

    template = (Path(__file__).parent.parent / "templates" / "qwen2_5_vl_chat_template.jinja").read_text()
    dtype = configs.get("weights_dtype")
    with tempfile.TemporaryDirectory() as tmp:
        # Qwen's vocabulary has each word of the pipeline's template whole: its system turn is the tokens the
        # pipeline drops. The tiny tokenizer is trained to match, or the states kept would be the template's.
        vocab = write_qwen_tokenizer(Path(tmp, "tokenizer"), configs["vocab_pieces"], template, seed,
                                     special=QWEN_VL_SPECIAL_TOKENS, added=(), whole=prefix.replace("<|im_end|>", ""))
        tokenizer = AutoTokenizer.from_pretrained(Path(tmp, "tokenizer"))
        dropped = len(tokenizer(prefix).input_ids)
        if dropped != drop:
            raise ValueError(f"the random tokenizer makes the template's system turn {dropped} tokens, not the "
                             f"{drop} the pipeline drops: raise vocab_pieces")
        config = Qwen2_5_VLConfig(text_config={"vocab_size": vocab, **configs["text_encoder"]},
                                  vision_config=configs["vision"], **vl_token_ids(tokenizer))
        modules = build_modules({
            "transformer": lambda: QwenImageTransformer2DModel(**configs["transformer"]),
            "vae": lambda: AutoencoderKLQwenImage(**configs["vae"]),
            "text_encoder": lambda: Qwen2_5_VLForConditionalGeneration(config),
        }, seed, streamed=dtype is not None)
        others = {"scheduler": FlowMatchEulerDiscreteScheduler(**configs["scheduler"]), "tokenizer": tokenizer,
                  **dict.fromkeys(later)}
        save_pipeline(configs.get("pipeline_class", "QwenImagePipeline"), modules, others, out_dir, dtype, seed,
                      configs.get("weights_for"), configs.get("weights_drawn", False))


FAMILY = Family(
    name="qwen_image",
    pipeline_classes=("QwenImagePipeline", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline",
                      "QwenImageControlNetPipeline"),
    submodules=(
        llm_encoder("text_encoder", TEXT_LAYERS),
        *transformer_specs(TRANSFORMER, HIDDEN, block_outputs=True),
        VAE_DECODER,
        VAE_ENCODER,
    ),
    constants=constants,
    runtime_constants=runtime_constants,
    derived_dims={**parts.VAE_DIMS, "image_tokens": image_tokens},
    tokenizers=("tokenizer",),
    build_random=build_random,
    # The pipeline's own template (no chat template), its first 34 tokens' states dropped; each prompt's own
    # tokens are read, padded to the call's longest
    prompt_formats={"tokenizer": PromptFormat(template=PROMPT_TEMPLATE, drop_tokens=DROP_TOKENS, padding="longest")},
)
