"""Wan adapters in the original checkpoint's module names, as the Wan repository, ComfyUI and the trainers that
follow them save them (`diffusion_model.blocks.0.self_attn.q.lora_A.weight`, `lora_down`/`lora_up` and `.alpha`
too), turned into diffusers' PEFT keys of the transformer, as diffusers' `_convert_non_diffusers_wan_lora_to_diffusers`
renames the modules (diffusers/loaders/lora_conversion_utils.py). The shared reader (runners/adapters/lora.py) reads
the rest: the up/down spellings and each module's alpha."""
from __future__ import annotations

import re

import numpy as np

# original module -> diffusers', within a block and at the top level
_BLOCK = {"self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v",
          "self_attn.o": "attn1.to_out.0", "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k",
          "cross_attn.v": "attn2.to_v", "cross_attn.o": "attn2.to_out.0", "cross_attn.k_img": "attn2.add_k_proj",
          "cross_attn.v_img": "attn2.add_v_proj", "ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2"}
_TOP = {"head.head": "proj_out", "time_projection.1": "condition_embedder.time_proj",
        "text_embedding.0": "condition_embedder.text_embedder.linear_1",
        "text_embedding.2": "condition_embedder.text_embedder.linear_2",
        "time_embedding.0": "condition_embedder.time_embedder.linear_1",
        "time_embedding.2": "condition_embedder.time_embedder.linear_2"}
_KEY = re.compile(r"^diffusion_model\.(?:blocks\.(?P<block>\d+)\.(?P<inner>[a-z_]+\.[a-z0-9_]+)|(?P<top>[a-z_]+\.\w+))"
                  r"\.(?P<rest>lora_[A-Za-z]+\.weight|alpha)$")


def to_diffusers_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name, array in tensors.items():
        match = _KEY.match(name)
        module = match and (_BLOCK.get(match["inner"]) if match["block"] else _TOP.get(match["top"]))
        if module and match["block"]:
            module = f"blocks.{match['block']}.{module}"
        out[f"transformer.{module}.{match['rest']}" if module else name] = array
    return out
