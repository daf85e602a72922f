"""FLUX.1 adapters in the original (Black Forest Labs) module names, as kohya's scripts save them
(`lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight`) and ComfyUI / ai-toolkit's BFL export
does (`diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight`, or lora_A / lora_B), turned
into the diffusers module names the artifact's weights record, as diffusers'
`_convert_kohya_flux_lora_to_diffusers` does (diffusers/loaders/lora_conversion_utils.py).

A fused original projection (a block's qkv, a single block's linear1 = q, k, v and the MLP input)
is several diffusers modules: its `up` is split along its output rows, each part with the whole
`down` (the change of each module is exactly its rows of the fused change). The final layer's
adaLN modulation holds (shift, scale) where diffusers' norm_out holds (scale, shift): its halves swap.
"""
from __future__ import annotations

import re

import numpy as np

# {original module, dots written as underscores: diffusers modules it holds, in its row order}.
# "{}" is the block index.
_DOUBLE = "transformer_blocks.{}."
_SINGLE = "single_transformer_blocks.{}."
MODULES = {
    r"double_blocks_(\d+)_img_attn_qkv": tuple(_DOUBLE + f"attn.to_{x}" for x in "qkv"),
    r"double_blocks_(\d+)_img_attn_proj": (_DOUBLE + "attn.to_out.0",),
    r"double_blocks_(\d+)_img_mlp_0": (_DOUBLE + "ff.net.0.proj",),
    r"double_blocks_(\d+)_img_mlp_2": (_DOUBLE + "ff.net.2",),
    r"double_blocks_(\d+)_img_mod_lin": (_DOUBLE + "norm1.linear",),
    r"double_blocks_(\d+)_txt_attn_qkv": tuple(_DOUBLE + f"attn.add_{x}_proj" for x in "qkv"),
    r"double_blocks_(\d+)_txt_attn_proj": (_DOUBLE + "attn.to_add_out",),
    r"double_blocks_(\d+)_txt_mlp_0": (_DOUBLE + "ff_context.net.0.proj",),
    r"double_blocks_(\d+)_txt_mlp_2": (_DOUBLE + "ff_context.net.2",),
    r"double_blocks_(\d+)_txt_mod_lin": (_DOUBLE + "norm1_context.linear",),
    r"single_blocks_(\d+)_linear1": (*(_SINGLE + f"attn.to_{x}" for x in "qkv"), _SINGLE + "proj_mlp"),
    r"single_blocks_(\d+)_linear2": (_SINGLE + "proj_out",),
    r"single_blocks_(\d+)_modulation_lin": (_SINGLE + "norm.linear",),
    "img_in": ("x_embedder",),
    "txt_in": ("context_embedder",),
    "time_in_in_layer": ("time_text_embed.timestep_embedder.linear_1",),
    "time_in_out_layer": ("time_text_embed.timestep_embedder.linear_2",),
    "vector_in_in_layer": ("time_text_embed.text_embedder.linear_1",),
    "vector_in_out_layer": ("time_text_embed.text_embedder.linear_2",),
    "guidance_in_in_layer": ("time_text_embed.guidance_embedder.linear_1",),
    "guidance_in_out_layer": ("time_text_embed.guidance_embedder.linear_2",),
    "final_layer_linear": ("proj_out",),
    "final_layer_adaLN_modulation_1": ("norm_out.linear",),
}
SWAPPED_HALVES = {"final_layer_adaLN_modulation_1"}  # (shift, scale) in FLUX.1, (scale, shift) in diffusers
_KEY = re.compile(r"^(?:lora_unet_|diffusion_model\.)(?P<module>.+?)\.(?P<role>lora_down|lora_up|lora_A|lora_B|alpha)"
                  r"(?:\.weight)?$")
_ROLE = {"lora_down": "lora_A", "lora_A": "lora_A", "lora_up": "lora_B", "lora_B": "lora_B", "alpha": "alpha"}


def _modules(original: str) -> tuple[str, tuple[str, ...]] | None:
    """(table key, diffusers modules) of an original module name (dots or underscores), or None."""
    flat = original.replace(".", "_")
    for pattern, modules in MODULES.items():
        match = re.fullmatch(pattern, flat)
        if match:
            return pattern, tuple(m.format(*match.groups()) for m in modules)
    return None


def to_diffusers_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The adapter with its FLUX.1-original keys as diffusers' PEFT keys of the transformer
    (`transformer.<module>.lora_A.weight`, `lora_B.weight`, `alpha`); other keys as they are (an
    original name this table does not hold stays too, so that the reader reports it as unmatched)."""
    out, groups = {}, {}
    for name, array in tensors.items():
        match = _KEY.match(name)
        found = match and _modules(match["module"])
        if not found:
            out[name] = array
            continue
        groups.setdefault(found, {})[_ROLE[match["role"]]] = array
    for (pattern, modules), roles in groups.items():
        up = roles.get("lora_B")
        if up is not None and pattern in SWAPPED_HALVES:
            up = np.concatenate(np.split(up, 2)[::-1])
        if up is not None and len(modules) > 1:  # q, k, v of the input's width; a single block's MLP the rest
            width = roles["lora_A"].shape[1] if "lora_A" in roles else up.shape[0] // len(modules)
            ups = np.split(up, [width * i for i in range(1, len(modules))])
        else:
            ups = [up] * len(modules)
        for module, part in zip(modules, ups):
            named = {"lora_A": roles.get("lora_A"), "lora_B": part, "alpha": roles.get("alpha")}
            out.update({f"transformer.{module}.{role}{'' if role == 'alpha' else '.weight'}": value
                        for role, value in named.items() if value is not None})
    return out
