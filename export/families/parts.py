"""Submodule descriptions several families share: CLIP text encoders by the outputs a pipeline
reads, and the VAE's decoder and encoder. The wrappers return only what the runner uses, so the
graphs carry nothing it throws away (the hidden states of every layer, the posterior object...)."""
from __future__ import annotations

import dataclasses
import functools

import torch

from export.spec import SubmoduleSpec, TensorSpec as T

# Which CLIP output each name means. SD1.5 reads the last state (after the final norm); SD3 and
# SDXL the penultimate one (before it) and CLIP-G's projected pooled embedding; Flux only CLIP-L's
# pooled state (the end token's, unprojected).
_CLIP_OUTPUTS = {
    "text_embeds": lambda out: out.text_embeds,
    "pooler_output": lambda out: out.pooler_output,
    "last_hidden_state": lambda out: out.last_hidden_state,
    "penultimate_hidden_states": lambda out: out.hidden_states[-2],
}


class _Clip(torch.nn.Module):
    def __init__(self, clip, outputs: tuple[str, ...]):
        super().__init__()
        self.clip, self.outputs = clip, outputs

    def forward(self, input_ids):
        out = self.clip(input_ids, output_hidden_states=True)
        return tuple(_CLIP_OUTPUTS[name](out) for name in self.outputs)


def clip(name: str, prefix: str, outputs: tuple[str, ...]) -> SubmoduleSpec:
    """A CLIP text encoder; `prefix` names its constants ({prefix}_width, _proj, _vocab)."""
    shapes = {"text_embeds": ("batch", f"{prefix}_proj"), "pooler_output": ("batch", f"{prefix}_width"),
              "last_hidden_state": ("batch", "clip_length", f"{prefix}_width"),
              "penultimate_hidden_states": ("batch", "clip_length", f"{prefix}_width")}
    return SubmoduleSpec(
        name=name,
        component=name,
        inputs=(T("input_ids", "int64", ("batch", "clip_length"), high=f"{prefix}_vocab"),),
        outputs=tuple(T(o, "float32", shapes[o]) for o in outputs),
        wrap=functools.partial(_Clip, outputs=outputs),
    )


def clip_constants(config: dict, prefix: str) -> dict[str, int]:
    return {f"{prefix}_width": config["hidden_size"], f"{prefix}_proj": config.get("projection_dim", 0),
            f"{prefix}_vocab": config["vocab_size"]}


class _T5Encoder(torch.nn.Module):
    def __init__(self, t5):
        super().__init__()
        self.t5 = t5

    def forward(self, input_ids):
        return (self.t5(input_ids).last_hidden_state,)


def t5_encoder(name: str) -> SubmoduleSpec:
    """A T5 encoder's last hidden states (SD3's third text encoder, Flux's second)."""
    return SubmoduleSpec(
        name=name,
        component=name,
        inputs=(T("input_ids", "int64", ("batch", "text_length"), high="t5_vocab"),),
        outputs=(T("last_hidden_state", "float32", ("batch", "text_length", "t5_width")),),
        wrap=_T5Encoder,
        # T5's default (sdpa) attention does not export under dynamo; eager does.
        load_kwargs={"attn_implementation": "eager"},
    )


class _MaskedT5Encoder(torch.nn.Module):
    def __init__(self, t5):
        super().__init__()
        self.t5 = t5

    def forward(self, input_ids, attention_mask):
        return (self.t5(input_ids, attention_mask=attention_mask).last_hidden_state,)


def masked_t5_encoder(name: str) -> SubmoduleSpec:
    """A T5 (or UMT5) encoder that reads an attention mask (Wan's UMT5): the last hidden states of a call's
    prompts padded to its longest, the padding masked. A real token's state does not depend on the padding (its
    keys are masked, the relative position bias depends on distances only), so the runner can run it on the
    call's longest prompt rather than the pipeline's padded length."""
    return dataclasses.replace(
        t5_encoder(name), inputs=(*t5_encoder(name).inputs, T("attention_mask", "int64", ("batch", "text_length"),
                                                             mask=True)),
        wrap=_MaskedT5Encoder)


def t5_constants(config: dict) -> dict[str, int]:
    return {"t5_width": config["d_model"], "t5_vocab": config["vocab_size"]}


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


_LATENT = ("batch", "latent_channels", "latent_height", "latent_width")
VAE_DECODER = SubmoduleSpec(
    name="vae_decoder",
    component="vae",
    inputs=(T("latent", "float32", _LATENT),),
    outputs=(T("image", "float32", ("batch", 3, "image_height", "image_width")),),
    wrap=_VaeDecoder,
    latent_divisor=1,  # its deepest level is the latent
    # Where the end-to-end time goes once the denoiser is fast: int8 activations where a target
    # quantizes whole submodules (OpenVINO's NNCF).
    quantization={"activations": True},
)
VAE_ENCODER = SubmoduleSpec(
    name="vae_encoder",
    component="vae",
    inputs=(T("image", "float32", ("batch", 3, "image_height", "image_width")),),
    outputs=(T("latent_mean", "float32", _LATENT), T("latent_logvar", "float32", _LATENT)),
    wrap=_VaeEncoder,
    latent_divisor=1,
)
# The image is the latent times the VAE's scale factor.
VAE_DIMS = {"image_height": ("latent_height", "vae_scale_factor", 0),
            "image_width": ("latent_width", "vae_scale_factor", 0)}


def vae_runtime_constants(vae: dict) -> dict:
    """What the runner needs to unscale latents before the decoder."""
    return {"vae_scaling_factor": vae["scaling_factor"], "vae_shift_factor": vae.get("shift_factor") or 0.0,
            "vae_scale_factor": 2 ** (len(vae["block_out_channels"]) - 1)}


def clip_tokenizers(folder, pads: dict[str, str]) -> dict:
    """{component: tokenizer} with CLIP's real vocabulary, written under `folder` and loaded back
    through from_pretrained as a downloaded one is. `pads`: {component: its pad token}."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from export.offline_tokenizers import write_clip_tokenizer

    tokenizers = {}
    for name, pad in pads.items():
        write_clip_tokenizer(Path(folder, name), pad_token=pad)
        tokenizers[name] = AutoTokenizer.from_pretrained(Path(folder, name))
    return tokenizers


def build_t5_pipeline(pipeline_class: str, configs: dict, out_dir, seed: int, clip_pads: dict[str, str], t5: str,
                      builders) -> None:
    """Write a random-weight pipeline folder of a family with a T5 encoder and flow matching (SD3,
    Flux): CLIP's real vocabulary (`clip_pads`: {tokenizer: its pad token}); a T5 SentencePiece model
    trained offline for the T5 encoder component `t5` (its tokenizer has the same number); the modules
    `builders(t5_config)` gives ({component: constructor}, in the order that seeds them); and the
    scheduler. configs["weights_dtype"] streams the weights in that dtype (too large to build in memory)."""
    import tempfile
    from pathlib import Path

    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import AutoTokenizer, T5Config

    from export.offline_tokenizers import write_t5_tokenizer
    from export.random_weights import build_modules, save_pipeline

    tokenizer = t5.replace("text_encoder", "tokenizer")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizers = clip_tokenizers(tmp, clip_pads)
        t5_vocab = write_t5_tokenizer(Path(tmp, tokenizer), configs["t5_vocab_pieces"], seed)
        tokenizers[tokenizer] = AutoTokenizer.from_pretrained(Path(tmp, tokenizer))
        # T5's embedding can be larger than the tokenizer (the real one: 32128 rows)
        t5_config = T5Config(vocab_size=configs.get("t5_vocab_size", t5_vocab), **configs[t5])
        dtype = configs.get("weights_dtype")
        modules = build_modules(builders(t5_config), seed, streamed=dtype is not None)
        save_pipeline(pipeline_class, modules,
                      {"scheduler": FlowMatchEulerDiscreteScheduler(**configs["scheduler"]), **tokenizers},
                      out_dir, dtype, seed, configs.get("weights_for"))


def residual_controlnet(transformer: SubmoduleSpec, control_shape: tuple, places, hidden: tuple, wrap,
                        latent_divisor, quantization: dict | None = None) -> SubmoduleSpec:
    """A ControlNet that reads the transformer's inputs and a control input of `control_shape`, and returns one
    residual of the hidden stream per place (`controlnet_block_<place>`), each times its `conditioning_scale`
    factor (Z-Image's and Qwen-Image's); run at every step as the transformer is, and quantized as it is."""
    return SubmoduleSpec(
        name="controlnet",
        component="controlnet",
        inputs=(*transformer.inputs, T("controlnet_cond", "float32", control_shape),
                T("conditioning_scale", "float32", (len(places),), high=2)),
        outputs=tuple(T(f"controlnet_block_{p}", "float32", hidden) for p in places),
        wrap=wrap,
        latent_divisor=latent_divisor,
        quantization=quantization or transformer.quantization,
    )


def video_defaults(entry, height: int, width: int, frames: int) -> dict:
    """A video pipeline's default size and frame count where the artifact's ranges hold them, else the ranges' opt
    values."""
    lo, opt, hi = entry.image_size
    fits = lo <= min(height, width) and max(height, width) <= hi
    frames_lo, frames_opt, frames_hi = entry.frames
    return {"default_height": height if fits else opt, "default_width": width if fits else opt,
            "default_num_frames": frames if frames_lo <= frames <= frames_hi else frames_opt}
