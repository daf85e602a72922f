"""Qwen-Image 2.1 (QwenImage21Pipeline), text to image: Qwen3-VL's language model read before its final norm, the
single-stream block-causal transformer as two graphs, and the RGBA VAE, as data.

The transformer sees one sequence, [prompt, image], in which the prompt's tokens are modulated at timestep 0 and
never attend to the image (its attention is causal over the prompt; the image's tokens attend to everything). So
the prompt's keys and values in every block are the same at every step: diffusers' pipeline computes them on the
first step ("extract") and reads them on the others ("cached"). The graphs make that split explicit:
- `transformer_prefix`: the prompt's states -> every block's keys and values, after RoPE, stacked
  (layers, batch, text tokens, heads, head dim), once a call;
- `transformer`: the image's tokens, the step's timestep and the prefix's keys and values -> the noise, every step.
Both run diffusers' own blocks, their attention given (`_Attention`) so that the rotary embedding is real
arithmetic on positions given as inputs (`txt_ids`, `img_ids`: diffusers' QwenImage21Rope builds a complex table
from Python lists) and the masks are additive; the prompt's padding (a call's prompts padded to the longest) is
masked as diffusers masks it.

Reference images (`image=`: editing, several references) go two ways, as in diffusers. Qwen3-VL reads them: its
vision tower (`image_encoder`, the images padded to one patch count, the learned position grid's interpolation and
the rotary positions given) gives the tokens the language model takes at the prompt's image tokens, and its
DeepStack features, added after the first layers at those tokens (`deepstack_states`: zeros elsewhere). The
transformer reads their latents (`vae_encoder`, RGBA): each image token of the prompt stands for 2 x 2 latent
tokens, which take its place in the prompt's sequence. Those tokens are modulated at timestep 0 and attend within
their image and to what comes before (block-causal), so the prefix (the prompt and the references) is computed once
a call too: `transformer_prefix` takes the prompt's states and the references' latents, where each goes in the
sequence (`prefix_index`), its image block (`prefix_blocks`, -1 for text), its key mask and rotary positions.

The VAE (AutoencoderKLQwenImage21) is already 2D (its "causal" convolutions are Conv2d on one frame); the decoder's
graph takes the pipeline's latents (N, 64, h, w) and holds the per-channel denormalisation; its image has 4
channels (RGBA). Its "nearest-exact" 2x upsampling is "nearest" (the same pixels at an integer scale).
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from export.families import parts
from export.families.llm_encoder import llm_constants
from export.families.qwen_image import GivenPositions, encoded, statistics, vl_token_ids
from export.families.qwen_image_edit import (REFERENCES, VLHiddenStates, image_area, vision_attention,
                                              vision_constants)
from runners.families.qwen_image_edit import calculate_dimensions
from export.families.z_image import rotated
from export.prompt_formats import load_tokenizer
from export.spec import Family, PromptFormat, SubmoduleSpec, TensorSpec as T

SYSTEM = "Comprehend and analyze the provided prompt."
# QwenImage21Pipeline's prompt_template_t2i: the system turn's tokens (drop_tokens) are dropped from the states
PROMPT_TEMPLATE = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{{}}<|im_end|>\n"
                   "<|im_start|>assistant\n")
VAE_SCALE = 16  # the pipeline's vae_scale_factor (fixed there); the image's sides are multiples of 32
LATENT_MULTIPLE = 2  # the transformer's image slots hold 2 x 2 latent tokens
SLOT = LATENT_MULTIPLE**2  # latent tokens an image token of the prompt stands for
MERGE_UNIT = 4  # patches the vision tower merges into a token (2 x 2)


def drop_tokens(folder) -> int:
    """The pipeline's _drop_idx: its system turn's tokens, as the processor's chat template renders it."""
    tok = load_tokenizer(folder / "processor")
    system = [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]}]
    return len(tok.apply_chat_template(system, tokenize=True, return_dict=False))


class _Attention:
    """QwenImage21AttnProcessor's projections, norms and rotary embedding, the rotation in real arithmetic
    (`rotary_emb`: (1 or N, S, head dim / 2, 2) cos and sin), the mask additive. `layer_cache` is a `_Keys`: the
    prefix graph records each block's keys and values into it; the image's graph reads the prefix's from it and
    attends over [prefix, image] keys, as diffusers' cached mode."""

    def __call__(self, attn, hidden_states, attention_mask=None, rotary_emb=None, layer_cache=None, **_):
        head_dim = attn.inner_dim // attn.heads
        q, k, v = (p(hidden_states).unflatten(-1, (-1, head_dim)) for p in (attn.to_q, attn.to_k, attn.to_v))
        q, k = rotated(attn.norm_q(q).to(v.dtype), rotary_emb), rotated(attn.norm_k(k).to(v.dtype), rotary_emb)
        if layer_cache.key is None:
            layer_cache.key, layer_cache.value = k, v
        else:
            k, v = torch.cat([layer_cache.key, k], dim=1), torch.cat([layer_cache.value, v], dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attention_mask)
        return attn.to_out[1](attn.to_out[0](out.transpose(1, 2).flatten(2, 3).type_as(q)))


@dataclasses.dataclass
class _Keys:
    key: torch.Tensor | None = None
    value: torch.Tensor | None = None


def _additive(allowed: torch.Tensor, dtype) -> torch.Tensor:
    return torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)


class _Vision(torch.nn.Module):
    """Qwen3-VL's vision tower on images padded to one patch count: (images, patches, patch values), each patch's
    4 taps into the learned position grid and their weights, its (row, column) and whether it is real -> each
    image's merged tokens (images, patches / 4, width) and the DeepStack features (layers, images, patches / 4,
    width). Each image attends within itself, padding masked: nothing is indexed by the images' sizes."""

    def __init__(self, model):
        super().__init__()
        self.model = model  # the component: its weights keep their checkpoint names under one prefix
        self.__dict__["visual"] = model.model.visual  # not a second child

    def forward(self, pixel_values, interp_indices, interp_weights, positions, patch_mask):
        visual = self.visual
        images, patches, _ = pixel_values.shape
        x = visual.patch_embed(pixel_values.reshape(images * patches, -1))
        x = x + (visual.pos_embed(interp_indices.reshape(images * patches, -1))
                 * interp_weights.reshape(images * patches, -1, 1)).sum(1)
        cos, sin = visual.rotary_pos_emb(x, positions.reshape(images * patches, 2))
        mask = torch.where(patch_mask.bool(), 0.0, torch.finfo(x.dtype).min)[:, None, None, :]
        deepstack = []
        for i, block in enumerate(visual.blocks):
            x = x + vision_attention(block.attn, block.norm1(x).reshape(images, patches, -1), cos, sin,
                                     mask).reshape(x.shape)
            x = x + block.mlp(block.norm2(x))
            if i in visual.deepstack_visual_indexes:
                deepstack.append(visual.deepstack_merger_list[visual.deepstack_visual_indexes.index(i)](x))
        tokens = patches // visual.spatial_merge_unit
        return (visual.merger(x).reshape(images, tokens, -1),
                torch.stack(deepstack).reshape(len(deepstack), images, tokens, -1))


class _DeepStackHiddenStates(VLHiddenStates):
    """Qwen3-VL's language model before its final norm, the vision tower's tokens at the image tokens and its
    DeepStack features added after the first layers (zeros off the image tokens: a plain add, where transformers
    scatters them into the image tokens' rows), with 3D rotary positions given."""

    def __init__(self, model, layers):
        super().__init__(model, layers, final_norm=False)
        self.stack._deepstack_process = lambda hidden, _positions, features: hidden + features.to(hidden.dtype)

    def forward(self, input_ids, attention_mask, position_ids, image_states, deepstack_states):
        return self.read(inputs_embeds=self.embeds(input_ids, image_states), attention_mask=attention_mask,
                         position_ids=position_ids, deepstack_visual_embeds=list(deepstack_states.unbind(0)))


class _Blocks(GivenPositions):
    """The transformer's blocks with `_Attention`, its rotary positions given as ids (3: frame, row, column)."""

    def __init__(self, transformer):
        super().__init__("transformer", transformer)
        for block in transformer.transformer_blocks:
            block.attn.set_processor(_Attention())

    def modulation(self, timestep, like):
        """The shared modulation of the timesteps (diffusers feeds sigma; its embedder multiplies by 1000)."""
        temb = self.transformer.time_text_embed(timestep, like)
        return temb, self.transformer.modulation(temb)

    def blocks(self, hidden, modulation, table, mask, caches):
        for block, cache in zip(self.transformer.transformer_blocks, caches):
            hidden = block(hidden_states=hidden, modulation=modulation, rotary_emb=table, attention_mask=mask,
                           target_token_mask=None, layer_cache=cache)
        return hidden


class _Prefix(_Blocks):
    """The prefix, the prompt's tokens and the references' in the order `prefix_index` gives (into the prompt's
    states, then the references' latents), at `timestep` (0, the runner's: an input, not a constant, so that the
    modulation's weights stay weights that an adapter changes): causal, each reference's tokens seeing each other
    too (`prefix_blocks`), the padding's keys masked -> every block's keys and values."""

    def forward(self, encoder_hidden_states, reference_latents, prefix_index, prefix_blocks, prefix_mask, prefix_ids,
                timestep):
        t = self.transformer
        hidden = torch.cat([t.txt_in(encoder_hidden_states), t.img_in(reference_latents)], dim=1)[:, prefix_index]
        _, modulation = self.modulation(timestep, hidden)
        order = torch.arange(hidden.shape[1], device=hidden.device)
        block = prefix_blocks[:, None]
        allowed = (order[:, None] >= order[None, :]) | ((block == prefix_blocks[None, :]) & (block >= 0))
        mask = _additive(allowed[None, None] & prefix_mask.bool()[:, None, None, :], hidden.dtype)
        caches = [_Keys() for _ in t.transformer_blocks]
        self.blocks(hidden, modulation, self._table(prefix_ids), mask, caches)
        return torch.stack([c.key for c in caches]), torch.stack([c.value for c in caches])


class _Image(_Blocks):
    """A step: the image's tokens at the step's timestep, attending to the prefix's keys and values (the
    padding's masked) and their own -> the noise."""

    def forward(self, hidden_states, timestep, img_ids, prefix_keys, prefix_values, prefix_mask):
        hidden = self.transformer.img_in(hidden_states)
        temb, modulation = self.modulation(timestep, hidden)
        image = torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
        mask = _additive(torch.cat([prefix_mask.bool(), image], dim=1)[:, None, None, :], hidden.dtype)
        caches = [_Keys(k, v) for k, v in zip(prefix_keys.unbind(0), prefix_values.unbind(0))]
        hidden = self.blocks(hidden, modulation, self._table(img_ids), mask, caches)
        return (self.transformer.proj_out(self.transformer.norm_out(hidden, temb, None)),)


def _one_frame(vae):
    """The VAE with each 2x "nearest-exact" upsampling "nearest" (see export/families/qwen_image.py's)."""
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage21 import QwenImage21Upsample

    for module in vae.modules():
        if isinstance(module, QwenImage21Upsample) and module.mode == "nearest-exact":
            assert all(float(f).is_integer() for f in module.scale_factor), module.scale_factor
            module.mode = "nearest"
    return vae


class _Encoder(torch.nn.Module):
    """RGBA image in [-1, 1] -> the posterior (mean, log-variance) in the pipeline's latent space, normalised as
    QwenImage21Pipeline normalises its references ((latents - mean) / std)."""

    def __init__(self, vae):
        super().__init__()
        self.vae = _one_frame(vae)

    def forward(self, image):
        latent, logvar, mean, std = encoded(self.vae, image)
        return (latent - mean) / std, logvar - 2 * torch.log(std)


class _Decoder(torch.nn.Module):
    """The pipeline's latents (N, 64, h, w) -> RGBA image in [-1, 1]: denormalised (latents * std + mean),
    decoded as one frame."""

    def __init__(self, vae):
        super().__init__()
        self.vae = _one_frame(vae)

    def forward(self, latent):
        mean, std = statistics(self.vae, latent.dtype)
        z = latent * std + mean
        return (self.vae.decode(z[:, :, None], return_dict=False)[0][:, :, 0],)


IMAGE_ENCODER = SubmoduleSpec(
    name="image_encoder",
    component="text_encoder",
    inputs=(T("pixel_values", "float32", ("vision_images", "vision_patches", "patch_values")),
            T("interp_indices", "int64", ("vision_images", "vision_patches", 4), high="vision_grid_last"),
            T("interp_weights", "float32", ("vision_images", "vision_patches", 4), high=1),
            T("positions", "int64", ("vision_images", "vision_patches", 2), high=64),
            T("patch_mask", "int64", ("vision_images", "vision_patches"), mask=True)),
    outputs=(T("image_embeds", "float32", ("vision_images", "vision_tokens", "text_width")),
             T("deepstack_embeds", "float32", ("deepstack_layers", "vision_images", "vision_tokens", "text_width"))),
    wrap=_Vision,
)
TEXT_ENCODER = SubmoduleSpec(
    name="text_encoder",
    component="text_encoder",
    inputs=(T("input_ids", "int64", ("batch", "vl_length"), high="text_vocab"),
            T("attention_mask", "int64", ("batch", "vl_length"), mask=True),
            T("position_ids", "int64", (3, "batch", "vl_length"), high="vl_length"),
            T("image_states", "float32", ("batch", "vl_length", "text_width")),
            T("deepstack_states", "float32", ("deepstack_layers", "batch", "vl_length", "text_width"))),
    outputs=(T("hidden_states", "float32", ("batch", "vl_length", "text_width")),),
    wrap=functools.partial(_DeepStackHiddenStates, layers=(-1,)),
    load_kwargs={"attn_implementation": "eager"},  # as llm_encoder's
)
KV_SHAPE = ("kv_layers", "batch", "prefix_length", "attention_heads", "attention_head_dim")
PREFIX_MASK = T("prefix_mask", "int64", ("batch", "prefix_length"), mask=True)
PREFIX = SubmoduleSpec(
    name="transformer_prefix",
    component="transformer",
    inputs=(T("encoder_hidden_states", "float32", ("batch", "text_length", "text_width")),
            T("reference_latents", "float32", ("batch", "reference_rows", "latent_channels")),
            T("prefix_index", "int64", ("prefix_length",), high="prefix_length"),
            T("prefix_blocks", "int64", ("prefix_length",), low=-1, high=2), PREFIX_MASK,
            T("prefix_ids", "float32", ("prefix_length", 3), high=64), T("timestep", "float32", (1,), high=1)),
    outputs=(T("prefix_keys", "float32", KV_SHAPE), T("prefix_values", "float32", KV_SHAPE)),
    wrap=_Prefix,
    quantization={"keep_scopes": ("txt_in", "img_in", "time_text_embed", "transformer.modulation")},
)
TRANSFORMER = SubmoduleSpec(
    name="transformer",
    component="transformer",
    inputs=(T("hidden_states", "float32", ("batch", "image_tokens", "latent_channels")),
            T("timestep", "float32", ("batch",), high=1),
            # Each image's positions (its frame after its prompts', which differ between guidance's halves); example
            # positions up to 64, as rows and columns centred on 0 are
            T("img_ids", "float32", ("batch", "image_tokens", 3), high=64),
            T("prefix_keys", "float32", KV_SHAPE), T("prefix_values", "float32", KV_SHAPE), PREFIX_MASK),
    outputs=(T("noise_pred", "float32", ("batch", "image_tokens", "latent_channels")),),
    wrap=_Image,
    latent_divisor=1,
    quantization={"denoiser": True, "keep_scopes": ("img_in", "time_text_embed", "transformer.modulation",
                                                    "norm_out", "transformer.proj_out"),
                  "fp32_scopes": ("time_text_embed",), "fp32_inputs": ("timestep",)},
)
RGBA = ("batch", "image_channels", "image_height", "image_width")
VAE_DECODER = dataclasses.replace(parts.VAE_DECODER, wrap=_Decoder, outputs=(T("image", "float32", RGBA),))
VAE_ENCODER = dataclasses.replace(parts.VAE_ENCODER, wrap=_Encoder, inputs=(T("image", "float32", RGBA),))


def image_tokens(dims: dict[str, int]) -> int:
    return dims["latent_height"] * dims["latent_width"]


def _references(dims: dict[str, int]) -> int:
    return dims.get("reference_tokens", 0)


# The prompt's sequence, the references' slots (one a 2 x 2 group of latent tokens) in it; the prefix, the prompt's
# tokens and the references' latent tokens; the references' rows, their tokens and a row of zeros that keeps the
# input from being empty in text to image
DERIVED = {
    "vl_length": lambda dims: dims["text_length"] + _references(dims) // SLOT,
    "prefix_length": lambda dims: dims["text_length"] + _references(dims),
    "reference_rows": lambda dims: _references(dims) + 1,
    "vision_tokens": lambda dims: dims["vision_patches"] // MERGE_UNIT,
}


def _vision(src) -> dict:
    vision = src.config("text_encoder")["vision_config"]
    if vision["spatial_merge_size"] ** 2 != MERGE_UNIT:
        raise ValueError(f"a vision tower merging {vision['spatial_merge_size']} x {vision['spatial_merge_size']} "
                         "patches: Qwen3-VL's merges 2 x 2")
    return vision


def constants(src) -> dict[str, int]:
    tr, vae, vision = src.config("transformer"), src.config("vae"), _vision(src)
    # A reference's patches (16 pixels, as its latent tokens) at the area the pipeline sizes it to: square, and the
    # most calculate_dimensions gives at aspect ratios from 1:4 to 4:1 (its rounding to 32 pixels adds up to 25%
    # at a tiny model's area)
    area, patch = image_area(src), vision["patch_size"]
    largest = max(w * h for w, h in (calculate_dimensions(area, r / 100) for r in range(25, 401)))
    return {
        **llm_constants(src.config("text_encoder"), (-1,)),
        "reference_tokens_max": REFERENCES * largest // patch**2,
        "vision_patches_opt": area // patch**2,
        "vision_patches_max": largest // patch**2,
        "vision_images_max": REFERENCES,
        "vision_grid_last": vision["num_position_embeddings"] - 1,
        "deepstack_layers": len(vision["deepstack_visual_indexes"]),
        "patch_values": vision["in_channels"] * vision["temporal_patch_size"] * vision["patch_size"] ** 2,
        "latent_channels": vae["z_dim"],
        "in_channels": tr["in_channels"],
        "image_channels": vae["out_channels"],
        "vae_scale_factor": VAE_SCALE,
        "latent_multiple": LATENT_MULTIPLE,
        "kv_layers": tr["num_layers"],
        "attention_heads": tr["num_attention_heads"],
        "attention_head_dim": tr["attention_head_dim"],
        "num_train_timesteps": src.config("scheduler")["num_train_timesteps"],
    }


def runtime_constants(src) -> dict:
    return {
        "vae_scaling_factor": 1.0, "vae_shift_factor": 0.0,  # the decoder's graph denormalises
        "vae_scale_factor": VAE_SCALE,
        "denoiser": "transformer",
        "latent_multiple": LATENT_MULTIPLE,
        "patch_size": 1,  # a token is a latent pixel (the schedule's shift counts them)
        # the sigmas: the folder's sample_sigmas (Turbo's), else 1 to 1 / steps; shifted by the image's tokens
        "schedule": {"sigmas": "linspace", "mu": "linear"},
        "sample_sigmas": src.model_index().get("sample_sigmas"),
        "references": REFERENCES,
        "image_area": image_area(src),
        "image_token_id": src.config("text_encoder")["image_token_id"],
        "vision": vision_constants(src, _vision(src)),
    }


def build_random(configs: dict, out_dir, seed: int = 0) -> None:
    """Write a QwenImage21Pipeline folder with random seeded weights from component configs (see the registry):
    Qwen3-VL (its language model at the configs' widths, its vision tower beside it, which text to image loads
    and never runs), and its processor: a Qwen2-kind tokenizer trained offline with Qwen3-VL's chat template and
    a PIL image processor at Qwen3-VL's patch size (written part by part: transformers builds Qwen3VLProcessor
    only with its video processor, which needs torchvision)."""
    import json
    import tempfile
    from pathlib import Path

    from diffusers import (
        AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline, QwenImage21Transformer2DModel,
    )
    from transformers import AutoTokenizer, Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from export.families.qwen_image_edit import processor
    from export.offline_tokenizers import QWEN_VL_SPECIAL_TOKENS, write_qwen_tokenizer
    from export.random_weights import build_modules

    template = (Path(__file__).parent.parent / "templates" / "qwen3_vl_chat_template.jinja").read_text()
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        vocab = write_qwen_tokenizer(Path(tmp), configs["vocab_pieces"], template, seed,
                                     special=QWEN_VL_SPECIAL_TOKENS, added=(), whole=SYSTEM)
        tokenizer = AutoTokenizer.from_pretrained(tmp)
    config = Qwen3VLConfig(text_config={"vocab_size": vocab, **configs["text_encoder"]},
                           vision_config=configs["vision"], **vl_token_ids(tokenizer))
    modules = build_modules({
        "transformer": lambda: QwenImage21Transformer2DModel(**configs["transformer"]),
        "vae": lambda: AutoencoderKLQwenImage21(**configs["vae"]),
        "text_encoder": lambda: Qwen3VLForConditionalGeneration(config),
    }, seed, streamed=False)
    vision = configs["vision"]  # Qwen3-VL-8B-Instruct's preprocessor_config.json: patches of 16, merged 2 x 2,
    # normalised to [-1, 1] (its pixel budget is the class's default here: a tiny model's references are small)
    images = Qwen2VLImageProcessorPil(patch_size=vision["patch_size"], merge_size=vision["spatial_merge_size"],
                                      temporal_patch_size=vision["temporal_patch_size"], image_mean=[0.5] * 3,
                                      image_std=[0.5] * 3)
    pipeline = QwenImage21Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**configs["scheduler"]),
                                   processor=processor(images, tokenizer, template, "Qwen3VLProcessor"), **modules)
    pipeline.register_modules(processor=None)  # written part by part below
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir / "processor")
    images.save_pretrained(out_dir / "processor")
    index = json.loads((out_dir / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen3VLProcessor"]
    (out_dir / "model_index.json").write_text(json.dumps(index, indent=2))


FAMILY = Family(
    name="qwen_image21",
    pipeline_classes=("QwenImage21Pipeline",),
    submodules=(
        IMAGE_ENCODER,
        TEXT_ENCODER,
        PREFIX,
        TRANSFORMER,
        VAE_DECODER,
        VAE_ENCODER,
    ),
    constants=constants,
    runtime_constants=runtime_constants,
    derived_dims={**parts.VAE_DIMS, "image_tokens": image_tokens, **DERIVED},
    tokenizers=("processor",),
    build_random=build_random,
    # The pipeline's own template (no chat template applied to the prompt), its system turn's states dropped;
    # each prompt's own tokens are read, padded to the call's longest
    prompt_formats={"processor": lambda src: PromptFormat(template=PROMPT_TEMPLATE, drop_tokens=drop_tokens(src.folder),
                                                          padding="longest")},
)
