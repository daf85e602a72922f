"""FLUX.2 klein KV (Flux2KleinKVPipeline, black-forest-labs/FLUX.2-klein-9b-kv): the reference images' attention keys
and values computed once, on the first step, and read on the others.

The KV checkpoint is trained for it: its reference tokens are modulated at a fixed timestep (0) and attend only to
each other, so their keys and values do not depend on the step or the image being made. (In klein's other
checkpoints they do: the references are modulated at the step's timestep and attend to the noisy image, so a step
cannot reuse them. Caching them there would be another model.) Two graphs of diffusers' own forward, with its KV
attention processors:
- `transformer_kv_extract`, the first step with references ("extract" mode): the image's noise prediction, and
  every block's reference keys and values after RoPE, stacked (double-stream blocks first, as diffusers' cache
  holds them): (layers, batch, reference tokens, heads, head dim);
- `transformer`, every other step ("cached" mode): the image's tokens only, the keys and values as inputs
  (none for text to image: diffusers' plain forward, which attention over no extra keys equals).
Both graphs hold the transformer's weights: the export is twice the transformer's size on disk.
"""
from __future__ import annotations

import torch

from export.families.flux import exact_timesteps, export_rope
from export.spec import SubmoduleSpec, TensorSpec as T

KV_SHAPE = ("kv_layers", "batch", "reference_tokens", "attention_heads", "attention_head_dim")


def is_kv(src) -> bool:
    """A KV checkpoint: its folder's pipeline class, or the registry entry's variant."""
    return src.model_index()["_class_name"] == "Flux2KleinKVPipeline" or src.entry.extra.get("variant") == "kv"


def kv_constants(config: dict) -> dict[str, int]:
    """The stacked keys' and values' constant axes, from the transformer's config."""
    return {"kv_layers": config["num_layers"] + config["num_single_layers"],
            "attention_heads": config["num_attention_heads"], "attention_head_dim": config["attention_head_dim"]}


def _with_kv_processors(transformer):
    """Flux2KleinKVPipeline's attention processors (its `_set_kv_attn_processors`), the rope in float32."""
    from diffusers.models.transformers.transformer_flux2 import (
        Flux2KVAttnProcessor, Flux2KVParallelSelfAttnProcessor,
    )

    for block in transformer.transformer_blocks:
        block.attn.set_processor(Flux2KVAttnProcessor())
    for block in transformer.single_transformer_blocks:
        block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())
    export_rope(transformer.pos_embed)
    return transformer


def _layers(cache) -> list:
    return cache.double_block_caches + cache.single_block_caches


class _Extract(torch.nn.Module):
    """The first step with references: [references, image] tokens in diffusers' extract mode."""

    def __init__(self, transformer):
        super().__init__()
        self.transformer = _with_kv_processors(transformer)

    def forward(self, hidden_states, reference_states, encoder_hidden_states, timestep, img_ids, reference_ids,
                txt_ids):
        with exact_timesteps(self.transformer, timestep, None):
            out, cache = self.transformer(
                hidden_states=torch.cat([reference_states, hidden_states], dim=1), timestep=timestep,
                encoder_hidden_states=encoder_hidden_states, img_ids=torch.cat([reference_ids, img_ids]),
                txt_ids=txt_ids, kv_cache_mode="extract", num_ref_tokens=reference_states.shape[1],
                return_dict=False)
        layers = _layers(cache)
        return out, torch.stack([layer.k_ref for layer in layers]), torch.stack([layer.v_ref for layer in layers])


class _Cached(torch.nn.Module):
    """A step after the first: the image's tokens, the references' keys and values read (diffusers' cached mode)."""

    def __init__(self, transformer):
        super().__init__()
        self.transformer = _with_kv_processors(transformer)

    def forward(self, hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, reference_keys,
                reference_values):
        from diffusers.models.transformers.transformer_flux2 import Flux2KVCache

        cache = Flux2KVCache(len(self.transformer.transformer_blocks), len(self.transformer.single_transformer_blocks))
        cache.num_ref_tokens = reference_keys.shape[2]
        for layer, key, value in zip(_layers(cache), reference_keys.unbind(0), reference_values.unbind(0)):
            layer.store(key, value)
        with exact_timesteps(self.transformer, timestep, None):
            out = self.transformer(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                                   timestep=timestep, img_ids=img_ids, txt_ids=txt_ids, kv_cache=cache,
                                   kv_cache_mode="cached", return_dict=False)
        return (out[0],)


_IMAGE = (T("hidden_states", "float32", ("batch", "latent_tokens", "latent_channels")),)
_TEXT = (T("encoder_hidden_states", "float32", ("batch", "text_length", "text_width")),
         T("timestep", "float32", ("batch",), high=1))
_KV = (T("reference_keys", "float32", KV_SHAPE), T("reference_values", "float32", KV_SHAPE))
_NOISE = (T("noise_pred", "float32", ("batch", "latent_tokens", "latent_channels")),)


def kv_transformers(quantization: dict) -> tuple[SubmoduleSpec, SubmoduleSpec]:
    """The cached-mode `transformer` and the extract-mode `transformer_kv_extract` of a KV checkpoint."""
    ids = (T("img_ids", "float32", ("latent_tokens", 4), high=64),)
    reference = (T("reference_states", "float32", ("batch", "reference_tokens", "latent_channels")),)
    reference_ids = (T("reference_ids", "float32", ("reference_tokens", 4), high=64),)
    txt_ids = (T("txt_ids", "float32", ("text_length", 4), high=64),)
    common = dict(component="transformer", latent_divisor=1, quantization=quantization, when=is_kv)
    return (SubmoduleSpec(name="transformer", inputs=(*_IMAGE, *_TEXT, *ids, *txt_ids, *_KV), outputs=_NOISE,
                          wrap=_Cached, **common),
            SubmoduleSpec(name="transformer_kv_extract",
                          inputs=(*_IMAGE, *reference, *_TEXT, *ids, *reference_ids, *txt_ids),
                          outputs=(*_NOISE, *_KV), wrap=_Extract, **common))
