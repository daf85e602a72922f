"""FLUX.1 adapters in the original (Black Forest Labs) module names (runners/adapters/original_names.py), as
diffusers' `_convert_kohya_flux_lora_to_diffusers` reads them: a single block's linear1 is q, k, v and the MLP
input; the final layer's adaLN modulation holds (shift, scale) where diffusers' norm_out holds (scale, shift)."""
from __future__ import annotations

from runners.adapters.original_names import OriginalNames

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

to_diffusers_names = OriginalNames(MODULES, frozenset(SWAPPED_HALVES))
