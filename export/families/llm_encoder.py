"""Prompt encoders that are decoder-only LLMs (Qwen3, the text path of Qwen2.5-VL, Mistral3's): the
hidden states of the layers a pipeline reads, from `input_ids` and `attention_mask` over `text_length`.

The graph stops at the deepest layer read. `hidden_states[k]` is the output of the first k decoder layers
(0: the token embeddings), and only the last entry passes the final norm: a pipeline that reads
`hidden_states[-2]` (Z-Image) never runs the last layer, one that reads layer 27 of 36 (FLUX.2 klein) never
runs 9, and none runs the language-model head that `Qwen3ForCausalLM` computes over the whole vocabulary for
every token. The export's report says what was cut (`graph`: layers kept, FLOPs per token saved).
"""
from __future__ import annotations

import functools
import sys
from typing import Callable

import torch

from export.spec import SubmoduleSpec, TensorSpec as T


def decoder_stack(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder layers' module (embed_tokens, layers, norm) of a bare model, a causal LM, or a
    vision-language model's language model."""
    for path in ("model.language_model", "language_model", "model", ""):
        module = model
        for part in filter(None, path.split(".")):
            module = getattr(module, part, None)
        if module is not None and hasattr(module, "layers") and hasattr(module, "embed_tokens"):
            return module
    raise TypeError(f"{type(model).__name__} has no decoder stack (embed_tokens, layers) where LLMs keep one")


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class LLMHiddenStates(torch.nn.Module):
    """input_ids, attention_mask -> the hidden states of `layers` (indices into `hidden_states`,
    negative from the end), concatenated on the feature axis in that order. `final_norm=False`: the last
    entry before the final norm, as a pipeline that hooks the norm out reads it (Qwen-Image 2.1)."""

    def __init__(self, model, layers, final_norm: bool = True):
        super().__init__()
        _register_attention()
        model.set_attn_implementation(ATTENTION)  # loaded as eager (llm_encoder's load_kwargs)
        layers = layers(model) if callable(layers) else layers
        stack = decoder_stack(model)
        total = len(stack.layers)
        if not all(-total - 1 <= k <= total for k in layers):
            raise ValueError(f"layers {tuple(layers)} to read: {type(model).__name__} has hidden states 0 to {total}")
        self.reads = [k % (total + 1) for k in layers]
        deepest = max(self.reads)
        lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        dropped = _params(stack.layers[deepest:]) + (_params(lm_head) if lm_head is not None else 0)
        if deepest < total or not final_norm:  # the norm applies to hidden_states[total] only
            dropped += _params(stack.norm)
            stack.layers = stack.layers[:deepest]
            stack.norm = torch.nn.Identity()
        self.model = model  # the component: its weights keep their checkpoint names under one prefix
        self.__dict__["stack"] = stack  # not a second child
        # Matrix products cost 2 FLOPs per weight per token; attention's own products (which grow with
        # the length) come on top, in the same proportion as the layers.
        self.export_notes = {"layers_read": self.reads, "layers_kept": deepest, "layers_total": total,
                             "lm_head_dropped": lm_head is not None,
                             "gflops_per_token_saved": float(f"{2 * dropped / 1e9:.3g}"),
                             "gflops_per_token_kept": float(f"{2 * _params(stack.layers) / 1e9:.3g}")}

    def forward(self, input_ids, attention_mask):
        return self.read(input_ids=input_ids, attention_mask=attention_mask)

    def read(self, **inputs) -> tuple[torch.Tensor]:
        """The decoder stack on `inputs`: the layers read, side by side."""
        states = self.stack(**inputs, output_hidden_states=True, use_cache=False).hidden_states
        return (torch.cat([states[k] for k in self.reads], dim=-1),)


ATTENTION = "diffusion_aot_eager"  # the attention the encoders' graphs are traced with


def _eager_as_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' eager attention of the module's model, with torch sdpa's rule for a query allowed no key
    (a left-padded prompt's padding, Mistral's): its output 0, where eager's softmax averages every value.
    from_pretrained's default, which the pipelines run, is sdpa; sdpa's masks do not trace, eager's do."""
    eager = sys.modules[type(module).__module__].eager_attention_forward
    out, weights = eager(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None:  # additive, (batch, 1, queries, keys): the dtype's minimum where masked
        allowed = (attention_mask > torch.finfo(attention_mask.dtype).min).any(dim=-1)
        out = out * allowed.transpose(1, 2)[..., None].to(out.dtype)  # out: (batch, queries, heads, head dim)
    return out, weights


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTENTION, _eager_as_sdpa)
    AttentionMaskInterface.register(ATTENTION, eager_mask)


def llm_encoder(name: str, layers: tuple[int, ...] | Callable[[torch.nn.Module], tuple[int, ...]],
                width: str = "text_width", vocab: str = "text_vocab", output: str = "hidden_states",
                final_norm: bool = True) -> SubmoduleSpec:
    """The LLM text encoder `name`, reading `layers` of `hidden_states` (or the model -> those layers, where
    its config says); its output's width is the constant `width` (the hidden size times the layers read)."""
    return SubmoduleSpec(
        name=name,
        component=name,
        inputs=(T("input_ids", "int64", ("batch", "text_length"), high=vocab),
                T("attention_mask", "int64", ("batch", "text_length"), mask=True)),
        outputs=(T(output, "float32", ("batch", "text_length", width)),),
        wrap=functools.partial(LLMHiddenStates, layers=layers, final_norm=final_norm),
        load_kwargs={"attn_implementation": "eager"},  # then ATTENTION: see LLMHiddenStates
    )


def llm_constants(config: dict, layers: tuple[int, ...], prefix: str = "text") -> dict[str, int]:
    """The widths an LLM encoder's shapes name: its config's, or its text config's (a VLM's)."""
    text = config.get("text_config", config)
    return {f"{prefix}_width": text["hidden_size"] * len(layers), f"{prefix}_vocab": text["vocab_size"]}
