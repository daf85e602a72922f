"""FLUX.2 adapters in the original (Black Forest Labs) module names (runners/adapters/original_names.py), as
diffusers' `_convert_non_diffusers_flux2_lora_to_diffusers` (ai-toolkit's, ComfyUI's `diffusion_model.`) and
`_convert_kohya_flux2_lora_to_diffusers` read them: a double block's qkv is three modules; a single block's
linear1 is diffusers' one fused `to_qkv_mlp_proj`; the modulations are shared by every block. As diffusers'
converters, the final layer's adaLN modulation maps to norm_out as it is (no halves swapped)."""
from __future__ import annotations

from runners.adapters.original_names import OriginalNames

_DOUBLE = "transformer_blocks.{}."
_SINGLE = "single_transformer_blocks.{}."
MODULES = {
    r"double_blocks_(\d+)_img_attn_qkv": tuple(_DOUBLE + f"attn.to_{x}" for x in "qkv"),
    r"double_blocks_(\d+)_txt_attn_qkv": tuple(_DOUBLE + f"attn.add_{x}_proj" for x in "qkv"),
    r"double_blocks_(\d+)_img_attn_proj": (_DOUBLE + "attn.to_out.0",),
    r"double_blocks_(\d+)_txt_attn_proj": (_DOUBLE + "attn.to_add_out",),
    r"double_blocks_(\d+)_img_mlp_0": (_DOUBLE + "ff.linear_in",),
    r"double_blocks_(\d+)_img_mlp_2": (_DOUBLE + "ff.linear_out",),
    r"double_blocks_(\d+)_txt_mlp_0": (_DOUBLE + "ff_context.linear_in",),
    r"double_blocks_(\d+)_txt_mlp_2": (_DOUBLE + "ff_context.linear_out",),
    r"single_blocks_(\d+)_linear1": (_SINGLE + "attn.to_qkv_mlp_proj",),
    r"single_blocks_(\d+)_linear2": (_SINGLE + "attn.to_out",),
    "img_in": ("x_embedder",),
    "txt_in": ("context_embedder",),
    "time_in_in_layer": ("time_guidance_embed.timestep_embedder.linear_1",),
    "time_in_out_layer": ("time_guidance_embed.timestep_embedder.linear_2",),
    "guidance_in_in_layer": ("time_guidance_embed.guidance_embedder.linear_1",),
    "guidance_in_out_layer": ("time_guidance_embed.guidance_embedder.linear_2",),
    "final_layer_linear": ("proj_out",),
    "final_layer_adaLN_modulation_1": ("norm_out.linear",),
    "single_stream_modulation_lin": ("single_stream_modulation.linear",),
    "double_stream_modulation_img_lin": ("double_stream_modulation_img.linear",),
    "double_stream_modulation_txt_lin": ("double_stream_modulation_txt.linear",),
}

to_diffusers_names = OriginalNames(MODULES)
