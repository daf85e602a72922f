"""Z-Image adapters in the original checkpoint's module names, as ComfyUI and the trainers that follow it save
them (`diffusion_model.layers.0.attention.to_q.lora_A.weight`, the attention's output projection as
`attention.out`), turned into diffusers' PEFT keys of the transformer, as diffusers'
`_convert_non_diffusers_z_image_lora_to_diffusers` does (diffusers/loaders/lora_conversion_utils.py). kohya's
`lora_unet_` names are read by the shared reader (runners/adapters/lora.py)."""
from __future__ import annotations

import re

import numpy as np

# The transformer's top-level modules: only these keys are Z-Image's (other families' adapters pass as they are)
_KEY = re.compile(r"^diffusion_model\.(?P<module>(?:layers|noise_refiner|context_refiner|all_final_layer|"
                  r"all_x_embedder|cap_embedder|t_embedder)\..+)$")
_OUT = re.compile(r"\.attention\.out\.")


def to_diffusers_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name, array in tensors.items():
        match = _KEY.match(name)
        out[f"transformer.{_OUT.sub('.attention.to_out.0.', match['module'])}" if match else name] = array
    return out
