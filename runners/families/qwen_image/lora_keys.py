"""Qwen-Image adapters in the names the trainers save them with, turned into diffusers' PEFT keys of the
transformer, as diffusers' `_convert_non_diffusers_qwen_lora_to_diffusers` reads them
(diffusers/loaders/lora_conversion_utils.py): the transformer's own module paths with no component prefix
(Qwen-Image-Lightning's files: `transformer_blocks.0.attn.to_q.lora_down.weight`, `.alpha`), the same under
`diffusion_model.` (ComfyUI's), and either with PEFT's `default.` adapter segment. kohya's `lora_unet_` names are
read by the shared reader (runners/adapters/lora.py)."""
from __future__ import annotations

import re

import numpy as np

# The transformer's top-level modules: only these keys are Qwen-Image's (other families' adapters pass as they are)
_KEY = re.compile(r"^(?:diffusion_model\.)?(?P<module>(?:transformer_blocks|img_in|txt_in|txt_norm|proj_out|norm_out|"
                  r"time_text_embed)\..+)$")


def to_diffusers_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name, array in tensors.items():
        match = _KEY.match(name)
        out[f"transformer.{match['module'].replace('.default.', '.')}" if match else name] = array
    return out
