"""FLUX.2 klein (Flux2KleinPipeline, its inpainting pipeline and its KV checkpoint's, export/families/flux2_kv.py)
and dev (Flux2Pipeline): an LLM's hidden states
at three layers side by side (klein: Qwen3's 9, 18 and 27; dev: Mistral3's text path's 10, 20 and 30), the FLUX.2
transformer (shared modulation, 4-axis rotary ids; dev's takes the guidance scale too) and FLUX.2's VAE, whose
32-channel latents the pipeline patchifies to 128 channels and normalises with the VAE's batch-norm running
statistics, as data.

The runner works on the pipeline's latents: patchified and normalised, (batch, 128, H/16, W/16). The
decoder's graph takes them and does the rest (x * std + mean, unpatchify, decode); the encoder's gives
its posterior in the same space, so that a reference image's latents (the posterior's mode) and an
inpainted image's are the pipeline's without a step outside the graphs. The transformer reads the
latents packed as tokens, the reference images' tokens after them (one token axis: 0 to N references
in one graph), and the text and image position ids (T, H, W, L), from which it builds its rotary
embedding in float32 (as FLUX.1's: export/families/flux.py).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from export.families import parts
from export.families.flux import exact_timesteps, export_rope
from export.families.flux2_kv import is_kv, kv_constants, kv_transformers
from export.families.llm_encoder import llm_constants, llm_encoder
from export.spec import Family, PromptFormat, SubmoduleSpec, TensorSpec as T

TEXT_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's text_encoder_out_layers (Qwen3)
DEV_TEXT_LAYERS = (10, 20, 30)  # Flux2Pipeline's (Mistral3)
# Flux2Pipeline's system turn before each prompt (diffusers' flux2/system_messages.py, from BFL's flux2)
DEV_SYSTEM_MESSAGE = ("You are an AI that reasons about image descriptions. You give structured responses focusing on "
                      "object relationships, object\nattribution and actions without speculation.")


def text_layers(config: dict) -> tuple[int, ...]:
    """The text encoder's layers the export reads: its (text) config's `hidden_states_layers` where it has one
    (the registry's shallow test and bench encoders set it; openvino.genai 2026.4.1 reads klein's whatever it
    says: bench/family_variants.py), else the pipeline's: dev's for a Mistral3 encoder, klein's for Qwen3."""
    default = DEV_TEXT_LAYERS if config.get("model_type") == "mistral3" else TEXT_LAYERS
    return tuple(config.get("text_config", config).get("hidden_states_layers") or default)


def is_dev(src) -> bool:
    """FLUX.2 dev (Flux2Pipeline: Mistral3 encoder, guidance embedding), not klein."""
    return src.model_index()["_class_name"] == "Flux2Pipeline"


PATCH = 2  # the VAE's latents are patchified 2 x 2 into the transformer's channels
# A reference image is kept at most 1024 x 1024 pixels (diffusers' and BFL's cap): this many tokens at most.
REFERENCE_AREA = 1024 * 1024
REFERENCES = 2  # the references an export's token range makes room for, by default


class _Transformer(torch.nn.Module):
    """The transformer with its inputs as Flux2KleinPipeline and Flux2Pipeline feed them (the timestep divided by
    1000, dev's guidance scale as it is, the ids without a batch axis: diffusers reads the first row's only)."""

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer
        export_rope(transformer.pos_embed)

    def forward(self, hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, guidance=None):
        with exact_timesteps(self.transformer, timestep, guidance):
            out = self.transformer(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                                   timestep=timestep, img_ids=img_ids, txt_ids=txt_ids, guidance=guidance,
                                   return_dict=False)
        return (out[0],)


def _statistics(vae):
    """The batch norm's mean and standard deviation, (1, 128, 1, 1): the pipeline's, with the config's eps."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    return mean, torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)


def patchify(x):
    """(B, C, H, W) -> (B, 4C, H/2, W/2), channel c * 4 + dy * 2 + dx (Flux2KleinPipeline._patchify_latents)."""
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(b, c * PATCH * PATCH, h // PATCH, w // PATCH)


def unpatchify(x):
    b, c, h, w = x.shape
    x = x.reshape(b, c // (PATCH * PATCH), PATCH, PATCH, h, w).permute(0, 1, 4, 2, 5, 3)
    return x.reshape(b, c // (PATCH * PATCH), h * PATCH, w * PATCH)


class _Decoder(torch.nn.Module):
    """The pipeline's latents -> image in [-1, 1]: denormalised, unpatchified, decoded."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, latent):
        mean, std = _statistics(self.vae)
        return (self.vae.decode(unpatchify(latent * std + mean), return_dict=False)[0],)


class _Encoder(torch.nn.Module):
    """Image in [-1, 1] -> the posterior (mean, log-variance) in the pipeline's latent space: patchified and
    normalised (the mode is what the pipelines read; a sample with unit noise in this space is one there)."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, image):
        posterior = self.vae.encode(image, return_dict=False)[0]
        mean, std = _statistics(self.vae)
        return (patchify(posterior.mean) - mean) / std, patchify(posterior.logvar) - 2 * torch.log(std)


def _has_guidance(src) -> bool:
    return bool(src.config("transformer").get("guidance_embeds"))


# The transformer's linear layers int8 and fp8 keep in float, what fp16 keeps in fp32, and the inputs it takes so
QUANTIZATION = {"denoiser": True, "keep_scopes": ("x_embedder", "time_guidance_embed", "context_embedder", "norm_out",
                                                  "transformer.proj_out"),
                "fp32_scopes": ("time_guidance_embed",), "fp32_inputs": ("timestep", "guidance")}


def _transformer(guidance: bool) -> SubmoduleSpec:
    """The transformer's description with dev's guidance input, or without (klein; its KV checkpoint's are
    export/families/flux2_kv.py's)."""
    return SubmoduleSpec(
        name="transformer",
        component="transformer",
        inputs=(
            T("hidden_states", "float32", ("batch", "image_tokens", "latent_channels")),
            T("encoder_hidden_states", "float32", ("batch", "text_length", "text_width")),
            T("timestep", "float32", ("batch",), high=1),
            T("img_ids", "float32", ("image_tokens", 4), high=64),
            T("txt_ids", "float32", ("text_length", 4), high=64),
            *((T("guidance", "float32", ("batch",), high=10),) if guidance else ()),
        ),
        outputs=(T("noise_pred", "float32", ("batch", "image_tokens", "latent_channels")),),
        wrap=_Transformer,
        latent_divisor=1,
        quantization=QUANTIZATION,
        when=lambda src: _has_guidance(src) == guidance and not is_kv(src),
    )


# The shared VAE graphs' tensors, around the pipeline's latent space
VAE_DECODER = dataclasses.replace(parts.VAE_DECODER, wrap=_Decoder)
VAE_ENCODER = dataclasses.replace(parts.VAE_ENCODER, wrap=_Encoder)


def _image_tokens(dims: dict[str, int]) -> int:
    """The transformer's token axis: the image's, then its references' (none at the range's min and opt)."""
    return dims["latent_height"] * dims["latent_width"] + dims.get("reference_tokens", 0)


def _scale(vae: dict) -> int:
    """Pixels per side of a latent token: the VAE's down-sampling times the patch."""
    return 2 ** (len(vae["block_out_channels"]) - 1) * PATCH


def _constants(src) -> dict[str, int]:
    tr, vae = src.config("transformer"), src.config("vae")
    scale = _scale(vae)
    references = src.entry.extra.get("references", REFERENCES)
    largest = min(REFERENCE_AREA, src.entry.image_size[2] ** 2)  # a reference is at most the cap's area
    return {
        **llm_constants(src.config("text_encoder"), text_layers(src.config("text_encoder"))),
        "latent_channels": vae["latent_channels"] * PATCH * PATCH,
        "in_channels": tr["in_channels"],
        "vae_scale_factor": scale,
        "latent_multiple": 1,
        "num_train_timesteps": src.config("scheduler")["num_train_timesteps"],
        "inner_dim": tr["num_attention_heads"] * tr["attention_head_dim"],
        "reference_tokens_max": references * largest // scale**2,
        **kv_constants(tr),
    }


def _latent_statistics(src) -> dict | None:
    """The VAE's batch-norm mean and standard deviation (128 each), which `output_type="latent"` needs to give
    diffusers' latents (unpatchified, denormalised); None where the folder holds no VAE weights (a scale check's)."""
    import numpy as np
    from safetensors import safe_open

    path = src.folder / "vae" / "diffusion_pytorch_model.safetensors"
    if not path.exists():
        return None
    with safe_open(str(path), "np") as f:
        if "bn.running_mean" not in f.keys():
            return None
        mean, var = (f.get_tensor(f"bn.running_{k}").astype(np.float32) for k in ("mean", "var"))
    std = np.sqrt(var + np.float32(src.config("vae")["batch_norm_eps"]))
    return {"mean": mean.tolist(), "std": std.tolist()}


def _runtime_constants(src) -> dict:
    return {
        "latent_statistics": _latent_statistics(src),
        "vae_scaling_factor": 1.0, "vae_shift_factor": 0.0,  # the graphs normalise (batch-norm statistics)
        "vae_scale_factor": _scale(src.config("vae")),
        "denoiser": "transformer",
        "latent_multiple": 1,
        "patch_size": 1,
        # Flux2KleinPipeline's sigmas, shifted by its empirical mu of the image's tokens and the steps
        "schedule": {"sigmas": "linspace", "mu": "empirical"},
        "text_encoder_out_layers": list(text_layers(src.config("text_encoder"))),
        # dev: the guidance scale as the transformer's input (no CFG); klein's distilled checkpoints run 4 steps
        # without guidance, the base ones CFG (model_index.json)
        "variant": "dev" if is_dev(src) else "klein-kv" if is_kv(src) else "klein",
        "distilled": is_kv(src) or bool(src.model_index().get("is_distilled", False)),  # KV: distilled only
        "reference_area": REFERENCE_AREA,
    }


def _klein_text(configs: dict, tmp, seed: int):
    """Qwen3 at the configs' widths and a Qwen2-kind tokenizer with Qwen3's chat template; the pipeline's flags."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from export.offline_tokenizers import write_qwen_tokenizer

    template = (TEMPLATES / "qwen3_chat_template.jinja").read_text()
    vocab = write_qwen_tokenizer(tmp / "tokenizer", configs["vocab_pieces"], template, seed)
    qwen = Qwen3Config(**{"vocab_size": vocab, **configs["text_encoder"]})
    return (lambda: Qwen3ForCausalLM(qwen), AutoTokenizer.from_pretrained(tmp / "tokenizer"),
            {"is_distilled": configs.get("is_distilled", True)})


def _dev_text(configs: dict, tmp, seed: int):
    """Mistral3 (its text path at the configs' widths, a small Pixtral vision tower) and a Mistral-kind tokenizer
    with Mistral Small 3.1's chat template (transformers' Mistral3 processor tests' copy,
    mistral_small_3_chat_template.jinja). FLUX.2 dev's folder holds a PixtralProcessor, whose tokenizer files these
    are; transformers builds that processor only with torchvision, which has no CPU build here, and a prompt's
    tokens are the tokenizer's either way (the processor renders the template and tokenizes it without adding
    special tokens: the template starts with <s>)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    from export.offline_tokenizers import TEKKEN_SPECIAL_TOKENS, mistral_tokenizer

    template = (TEMPLATES / "mistral_small_3_chat_template.jinja").read_text()
    tokenizer = mistral_tokenizer(configs["vocab_pieces"], template, configs["padding_side"], seed)
    config = Mistral3Config(text_config={"model_type": "mistral", "vocab_size": len(tokenizer),
                                         **configs["text_encoder"]},
                            vision_config={"model_type": "pixtral", **configs["vision"]},
                            image_token_index=TEKKEN_SPECIAL_TOKENS.index("[IMG]"), spatial_merge_size=2)
    return lambda: Mistral3ForConditionalGeneration(config), tokenizer, {}


TEMPLATES = Path(__file__).parent.parent / "templates"


def build_random(configs: dict, out_dir, seed: int = 0) -> None:
    """Write a Flux2KleinPipeline folder (or a Flux2Pipeline or Flux2KleinKVPipeline one, where the configs'
    pipeline_class says) with
    random seeded weights from component configs (see the registry): the text encoder and its tokenizer
    trained offline (`_klein_text`, `_dev_text`), and the VAE's batch-norm statistics drawn too (a fresh
    module's are 0 and 1, which would leave their use untested)."""
    import tempfile

    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    from export.random_weights import build_modules, save_pipeline

    def vae():
        module = AutoencoderKLFlux2(**configs["vae"])
        if dtype is None:
            generator = torch.Generator().manual_seed(seed)
            module.bn.running_mean.normal_(0, 0.5, generator=generator)
            module.bn.running_var.uniform_(0.25, 4.0, generator=generator)
        return module

    dtype = configs.get("weights_dtype")
    pipeline = configs.get("pipeline_class", "Flux2KleinPipeline")
    with tempfile.TemporaryDirectory() as tmp:
        text = _dev_text if pipeline == "Flux2Pipeline" else _klein_text
        text_encoder, tokenizer, flags = text(configs, Path(tmp), seed)
        modules = build_modules({
            "transformer": lambda: Flux2Transformer2DModel(**configs["transformer"]),
            "vae": vae,
            "text_encoder": text_encoder,
        }, seed, streamed=dtype is not None)
        save_pipeline(pipeline, modules, {"scheduler": FlowMatchEulerDiscreteScheduler(**configs["scheduler"]),
                                          "tokenizer": tokenizer, **flags},
                      out_dir, dtype, seed, configs.get("weights_for"))


# Flux2KleinPipeline: Qwen3's chat template with thinking off. Flux2Pipeline: Mistral Small's, its system turn
# first, each turn's content as parts (its processor's), no generation prompt, "[IMG]" taken out of the prompt.
# Both pad to max_sequence_length: the transformer attends to every token, the padding's too.
KLEIN_PROMPT = PromptFormat(chat={"enable_thinking": False}, padding="max_length")
DEV_PROMPT = PromptFormat(system=DEV_SYSTEM_MESSAGE, parts=True, generation_prompt=False, removed=("[IMG]",),
                          padding="max_length")


FAMILY = Family(
    name="flux2",
    pipeline_classes=("Flux2KleinPipeline", "Flux2KleinInpaintPipeline", "Flux2KleinKVPipeline", "Flux2Pipeline"),
    submodules=(
        llm_encoder("text_encoder", lambda model: text_layers(model.config.to_dict())),
        _transformer(guidance=False),
        _transformer(guidance=True),
        *kv_transformers(QUANTIZATION),
        VAE_DECODER,
        VAE_ENCODER,
    ),
    constants=_constants,
    runtime_constants=_runtime_constants,
    derived_dims={**parts.VAE_DIMS, "image_tokens": _image_tokens,
                  "latent_tokens": lambda dims: dims["latent_height"] * dims["latent_width"]},
    tokenizers=("tokenizer",),
    build_random=build_random,
    prompt_formats={"tokenizer": lambda src: DEV_PROMPT if is_dev(src) else KLEIN_PROMPT},
)
