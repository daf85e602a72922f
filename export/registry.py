"""Every model diffusion-aot knows by name, as data.

An entry names its family (which fixes the submodules and their tensors), where its weights
come from (a Hugging Face hub id, or component configs for a random-weight pipeline built
locally), and the image-size range its engines are built for.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelEntry:
    name: str
    family: str
    hub_id: str | None = None  # loaded from a local folder, the HF cache, or a download
    random_configs: dict | None = None  # or built locally with random seeded weights
    # Image side in pixels: min, opt, max. Engines are built for this range; the runner's default is opt.
    image_size: tuple[int, int, int] = (256, 1024, 1536)
    batch: tuple[int, int, int] = (1, 2, 8)  # transformer batch is 2x the images (guidance)
    text_length: tuple[int, int, int] = (1, 256, 512)
    # A video model's frames (min, opt, max), each 4k + 1 for Wan; None for an image model.
    frames: tuple[int, int, int] | None = None
    # The weights' and the graphs' dtype: float16 halves the export's memory, and its engines are fp16.
    export_dtype: str = "float32"
    description: str = ""
    extra: dict = field(default_factory=dict)


_SD3_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0}
# The scheduler_config.json of stable-diffusion-v1-5 (PNDM, PLMS steps) and of SDXL base (Euler).
_DDPM = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
         "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1, "clip_sample": False,
         "trained_betas": None}
SD15_SCHEDULER = {"_class_name": "PNDMScheduler", **_DDPM}
SDXL_SCHEDULER = {"_class_name": "EulerDiscreteScheduler", **_DDPM, "interpolation_type": "linear",
                  "prediction_type": "epsilon", "sample_max_value": 1.0, "timestep_spacing": "leading",
                  "use_karras_sigmas": False}
_SD3_VAE = {  # the real SD3 VAE structure: 16 latent channels, 4 blocks (scale factor 8)
    "in_channels": 3, "out_channels": 3, "latent_channels": 16,
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "scaling_factor": 1.5305, "shift_factor": 0.0609,
    "use_quant_conv": False, "use_post_quant_conv": False,
}

def _mmdit(heads: int, head_dim: int, joint: int, pooled: int, sample: int, pos_max: int, **sd35) -> dict:
    """SD3's MMDiT; SD3.5 adds `qk_norm="rms_norm"` and `dual_attention_layers` (a second
    self-attention on the image stream in those blocks)."""
    return {
        "sample_size": sample, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 2,
        "attention_head_dim": head_dim, "num_attention_heads": heads, "joint_attention_dim": joint,
        "caption_projection_dim": heads * head_dim, "pooled_projection_dim": pooled, "pos_embed_max_size": pos_max,
        **sd35,
    }


def _clip(width: int, mlp: int, heads: int, act: str) -> dict:
    """CLIP text encoder with projection; CLIP-L uses quick_gelu, CLIP-G gelu."""
    return {
        "vocab_size": 49408, "hidden_size": width, "intermediate_size": mlp, "num_hidden_layers": 2,
        "num_attention_heads": heads, "max_position_embeddings": 77, "projection_dim": width,
        "hidden_act": act, "bos_token_id": 49406, "eos_token_id": 49407, "pad_token_id": 1,
    }


def _t5(width: int, head_dim: int, heads: int, mlp: int) -> dict:
    """T5 v1.1 encoder: gated-gelu."""
    return {
        "d_model": width, "d_kv": head_dim, "d_ff": mlp, "num_layers": 2, "num_heads": heads,
        "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32,
        "relative_attention_max_distance": 128, "is_encoder_decoder": False, "use_cache": False,
    }


# SD3-medium at tiny widths: CLIP-L (32) + CLIP-G (48) < T5 (96), pooled 32 + 48 = 80.
SD3_TINY = {
    "transformer": _mmdit(heads=4, head_dim=8, joint=96, pooled=80, sample=16, pos_max=96),
    "vae": {**_SD3_VAE, "block_out_channels": [8, 16, 16, 16], "layers_per_block": 1,
            "norm_num_groups": 4, "sample_size": 128},
    "text_encoder": _clip(32, 64, 4, "quick_gelu"),
    "text_encoder_2": _clip(48, 96, 4, "gelu"),
    "text_encoder_3": _t5(96, 16, 6, 128),
    "t5_vocab_pieces": 1000,
    "scheduler": _SD3_SCHEDULER,
}

# SD3.5-medium's transformer at tiny widths: per-head RMS norm of q and k, and a second attention
# in the first block.
SD35_TINY = {
    **SD3_TINY,
    "transformer": _mmdit(heads=4, head_dim=8, joint=96, pooled=80, sample=16, pos_max=96,
                          qk_norm="rms_norm", dual_attention_layers=[0]),
}

# SD3-medium's real widths with 2 layers in the transformer and in each text encoder: the FLOPs
# per layer are real, and a whole pipeline runs in minutes on a 2-core CPU (benchmarks).
SD3_BENCH = {
    "transformer": _mmdit(heads=24, head_dim=64, joint=4096, pooled=2048, sample=128, pos_max=192),
    "vae": {**_SD3_VAE, "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2,
            "norm_num_groups": 32, "sample_size": 1024},  # the real SD3 VAE
    "text_encoder": _clip(768, 3072, 12, "quick_gelu"),
    "text_encoder_2": _clip(1280, 5120, 20, "gelu"),
    "text_encoder_3": _t5(4096, 64, 64, 10240),
    "t5_vocab_pieces": 1000,
    "scheduler": _SD3_SCHEDULER,
}

def _unet(widths, down, up, heads, cross: int, groups: int, layers=2, **sdxl) -> dict:
    """UNet2DConditionModel: `down`/`up` name the blocks ("Cross" for CrossAttn...Block2D);
    `heads` is per block (diffusers calls it attention_head_dim)."""
    block = {"Cross": "CrossAttn{}Block2D", "Plain": "{}Block2D"}
    return {
        "sample_size": 64, "in_channels": 4, "out_channels": 4, "layers_per_block": layers,
        "block_out_channels": list(widths), "attention_head_dim": heads, "cross_attention_dim": cross,
        "norm_num_groups": groups,
        "down_block_types": [block[b].format("Down") for b in down],
        "up_block_types": [block[b].format("Up") for b in up],
        **sdxl,
    }


def _sdxl_unet(widths, heads, transformer_layers, cross: int, pooled: int, time_dim: int, groups: int) -> dict:
    """SDXL's UNet: no cross-attention in the first block, linear projections, and the pooled
    text embedding plus six size conditions ("text_time") added to the time embedding."""
    down = ["Plain"] + ["Cross"] * (len(widths) - 1)
    return _unet(widths, down, down[::-1], heads, cross, groups, transformer_layers_per_block=transformer_layers,
                 use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=time_dim,
                 projection_class_embeddings_input_dim=6 * time_dim + pooled)


def _vae4(widths, layers: int, groups: int, scaling: float, **extra) -> dict:
    """The 4-channel VAE of SD1.x and SDXL (quant convs, no shift)."""
    return {"in_channels": 3, "out_channels": 3, "latent_channels": 4, "block_out_channels": list(widths),
            "down_block_types": ["DownEncoderBlock2D"] * len(widths), "up_block_types": ["UpDecoderBlock2D"] * len(widths),
            "layers_per_block": layers, "norm_num_groups": groups, "scaling_factor": scaling, **extra}


_SD15_BLOCKS = (["Cross"] * 3 + ["Plain"], ["Plain"] + ["Cross"] * 3)
# SD1.5's architecture at tiny widths: four UNet blocks (three with cross-attention), CLIP-L.
SD15_TINY = {
    "unet": _unet((16, 32, 32, 32), *_SD15_BLOCKS, heads=4, cross=32, groups=8),
    "vae": _vae4((8, 16, 16, 16), 1, 4, 0.18215),
    "text_encoder": _clip(32, 64, 4, "quick_gelu"),
    "scheduler": SD15_SCHEDULER,
}
# SD1.5's inpainting UNet at the same tiny widths: 9 input channels, the latents followed by the
# latent-size mask and the masked image's latents (stable-diffusion-inpainting's structure).
SD15_INPAINT_TINY = {
    **SD15_TINY,
    "unet": {**SD15_TINY["unet"], "in_channels": 9},
    "pipeline_class": "StableDiffusionInpaintPipeline",
}
# The real SD1.5: UNet (320, 640, 1280, 1280) with 2 layers per block, cross-attention width 768,
# CLIP-L at full depth and the real VAE, with random weights (benchmarks: about 1.07 B parameters).
SD15_BENCH = {
    "unet": _unet((320, 640, 1280, 1280), *_SD15_BLOCKS, heads=8, cross=768, groups=32),
    "vae": _vae4((128, 256, 512, 512), 2, 32, 0.18215),
    "text_encoder": {**_clip(768, 3072, 12, "quick_gelu"), "num_hidden_layers": 12},
    "scheduler": SD15_SCHEDULER,
}
# SDXL's architecture at tiny widths: three blocks, the first without attention, two transformer
# layers in the last; CLIP-L (32) and CLIP-G (32) side by side for a cross-attention width of 64.
SDXL_TINY = {
    "unet": _sdxl_unet((16, 32, 32), heads=[2, 4, 4], transformer_layers=[1, 1, 2], cross=64, pooled=32,
                       time_dim=8, groups=8),
    "vae": _vae4((8, 16, 16, 16), 1, 4, 0.13025, force_upcast=True),
    "text_encoder": _clip(32, 64, 4, "quick_gelu"),
    "text_encoder_2": _clip(32, 64, 4, "gelu"),
    "scheduler": SDXL_SCHEDULER,
}

# SD3-medium at its true shapes: the 24-block MMDiT (2 B parameters), CLIP-L, CLIP-G (32 layers)
# and T5-XXL (24 layers, 4.7 B), random weights streamed to disk in fp16 (about 15 GB): what a
# user's real checkpoint costs the exporter (make scale-check).
SD3_FULLSIZE = {
    **SD3_BENCH,
    "transformer": {**SD3_BENCH["transformer"], "num_layers": 24},
    "text_encoder": {**SD3_BENCH["text_encoder"], "num_hidden_layers": 12},
    "text_encoder_2": {**SD3_BENCH["text_encoder_2"], "num_hidden_layers": 32},
    "text_encoder_3": {**SD3_BENCH["text_encoder_3"], "num_layers": 24},
    "t5_vocab_size": 32128,
    "weights_dtype": "float16",
}

# SD3.5-large's MMDiT (8.1 B parameters: 38 blocks of 38 heads, q/k RMS norm) and nothing else
# with weights: the other components are configs only, which give the shapes (`weights_for`).
SD35_LARGE_TRANSFORMER = {
    **SD3_FULLSIZE,
    "transformer": {**_mmdit(heads=38, head_dim=64, joint=4096, pooled=2048, sample=128, pos_max=192,
                             qk_norm="rms_norm"), "num_layers": 38},
    "weights_for": ["transformer"],
}

# FLUX.1's scheduler configs: dev shifts by the image's token count; schnell does not shift.
_FLUX_DEV_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                       "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096}
_FLUX_SCHNELL_SCHEDULER = {**_FLUX_DEV_SCHEDULER, "shift": 1.0, "use_dynamic_shifting": False}
_FLUX_VAE = {**_SD3_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159}  # SD3's structure, FLUX.1's factors


def _flux(heads: int, head_dim: int, joint: int, pooled: int, double: int, single: int, rope: tuple[int, ...],
          guidance: bool = True) -> dict:
    """FluxTransformer2DModel: `double` double-stream blocks then `single` single-stream ones; the
    rotary axes (`rope`: text, height, width) sum to the head dim. dev has a guidance embedding."""
    return {"patch_size": 1, "in_channels": 64, "num_layers": double, "num_single_layers": single,
            "attention_head_dim": head_dim, "num_attention_heads": heads, "joint_attention_dim": joint,
            "pooled_projection_dim": pooled, "guidance_embeds": guidance, "axes_dims_rope": list(rope)}


# FLUX.1-dev at tiny widths: head dim 64 (TensorRT's attention kernels want it), two heads, one
# double-stream block and two single-stream ones; CLIP-L (32) and T5 (64) at tiny widths.
FLUX_TINY = {
    "transformer": _flux(heads=2, head_dim=64, joint=64, pooled=32, double=1, single=2, rope=(16, 24, 24)),
    "vae": {**_FLUX_VAE, "block_out_channels": [8, 16, 16, 16], "layers_per_block": 1, "norm_num_groups": 4,
            "sample_size": 128},
    "text_encoder": _clip(32, 64, 4, "quick_gelu"),
    "text_encoder_2": _t5(64, 16, 4, 128),
    "t5_vocab_pieces": 1000,
    "scheduler": _FLUX_DEV_SCHEDULER,
}
# FLUX.1-schnell at the same widths: no guidance embedding, no resolution shift.
FLUX_SCHNELL_TINY = {
    **FLUX_TINY,
    "transformer": {**FLUX_TINY["transformer"], "guidance_embeds": False},
    "scheduler": _FLUX_SCHNELL_SCHEDULER,
}
# FLUX.1 Fill at the same widths: the transformer reads 384 packed channels, the latents' 64 followed by
# the masked image's latents (64) and the pixel mask folded into 8x8 patches (256) (FLUX.1-Fill-dev's).
FLUX_FILL_TINY = {
    **FLUX_TINY,
    "transformer": {**FLUX_TINY["transformer"], "in_channels": 384, "out_channels": 64},
    "pipeline_class": "FluxFillPipeline",
}
# FLUX.1 Canny/Depth at the same widths: the transformer reads 128 packed channels, the latents' 64 followed
# by the control image's latents (64) (FLUX.1-Canny-dev's and FLUX.1-Depth-dev's).
FLUX_CONTROL_TINY = {
    **FLUX_TINY,
    "transformer": {**FLUX_TINY["transformer"], "in_channels": 128, "out_channels": 64},
    "pipeline_class": "FluxControlPipeline",
}
# FLUX.1 Kontext at the same widths: FLUX.1-dev's transformer layout, saved as a FluxKontextPipeline.
FLUX_KONTEXT_TINY = {**FLUX_TINY, "pipeline_class": "FluxKontextPipeline"}
# FLUX.1's real widths (3072 = 24 heads of 128, joint width 4096) with 2 double-stream and 4
# single-stream blocks; the real CLIP-L and VAE; T5-XXL's width at 2 layers (benchmarks).
FLUX_BENCH = {
    "transformer": _flux(heads=24, head_dim=128, joint=4096, pooled=768, double=2, single=4, rope=(16, 56, 56)),
    "vae": {**_FLUX_VAE, "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "norm_num_groups": 32,
            "sample_size": 1024},
    "text_encoder": {**_clip(768, 3072, 12, "quick_gelu"), "num_hidden_layers": 12},
    "text_encoder_2": _t5(4096, 64, 64, 10240),
    "t5_vocab_pieces": 1000,
    "scheduler": _FLUX_DEV_SCHEDULER,
}
# FLUX.1-dev at its true shapes (19 double + 38 single blocks: 12 B parameters) and the other
# components' true configs; only the transformer gets weights, streamed in fp16 (make scale-check).
FLUX_FULLSIZE = {
    **FLUX_BENCH,
    "transformer": {**FLUX_BENCH["transformer"], "num_layers": 19, "num_single_layers": 38},
    "text_encoder_2": {**FLUX_BENCH["text_encoder_2"], "num_layers": 24},
    "t5_vocab_size": 32128,
    "weights_dtype": "float16",
    "weights_for": ["transformer"],
}

# Z-Image: the transformer's real layout (3 rotary axes of 32, 48, 48 over 30 heads; captions of 2560) at
# tiny widths; Qwen3's (head dim 128, 8 key-value heads) likewise. Turbo's scheduler: shift 3, no
# resolution shift; the base model's: shift 6.
def _z_image(dim: int, heads: int, layers: int, refiners: int, caption: int) -> dict:
    """ZImageTransformer2DModel; `dim` / `heads` is the head dim the rotary axes (caption, rows, columns) share."""
    head = dim // heads
    axes = [head // 4, head * 3 // 8, head * 3 // 8]
    return {"all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16, "dim": dim, "n_layers": layers,
            "n_refiner_layers": refiners, "n_heads": heads, "n_kv_heads": heads, "cap_feat_dim": caption,
            "axes_dims": axes, "axes_lens": [1536, 512, 512], "norm_eps": 1e-05, "qk_norm": True,
            "rope_theta": 256.0, "t_scale": 1000.0}


def _qwen3(width: int, layers: int, heads: int, kv_heads: int, head_dim: int, mlp: int) -> dict:
    return {"hidden_size": width, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim, "intermediate_size": mlp, "rms_norm_eps": 1e-06,
            "rope_theta": 1000000, "max_position_embeddings": 40960, "tie_word_embeddings": True}


_Z_IMAGE_TURBO_SCHEDULER = {"num_train_timesteps": 1000, "use_dynamic_shifting": False, "shift": 3.0}
Z_IMAGE_TINY = {
    "transformer": _z_image(dim=128, heads=2, layers=2, refiners=1, caption=64),
    # flux-tiny's VAE (FLUX.1's, as Z-Image's is), at flux-tiny's image sizes: the tests' export links its graphs
    "vae": FLUX_TINY["vae"],
    # 3 layers: the encoder's graph keeps 2 (it reads hidden_states[-2])
    "text_encoder": _qwen3(64, 3, 4, 2, 16, 128),
    "vocab_pieces": 400,
    "scheduler": _Z_IMAGE_TURBO_SCHEDULER,
}

# Z-Image's real widths (3840 = 30 heads of 128, captions of 2560) with 2 main layers and 1 refiner of each kind;
# Qwen3-4B's real widths at 3 layers (the encoder's graph keeps 2); FLUX.1's real VAE (benchmarks).
Z_IMAGE_BENCH = {
    "transformer": _z_image(dim=3840, heads=30, layers=2, refiners=1, caption=2560),
    "vae": FLUX_BENCH["vae"],
    "text_encoder": _qwen3(2560, 3, 32, 8, 128, 9728),
    "vocab_pieces": 1000,
    "scheduler": _Z_IMAGE_TURBO_SCHEDULER,
}
# Z-Image-Turbo at its true shapes (30 layers, 2 refiners of each kind: 6.2 B parameters) and the whole Qwen3-4B
# (36 layers, its 151936-token embedding); they get weights, streamed in fp16 (make scale-check).
Z_IMAGE_FULLSIZE = {
    **Z_IMAGE_BENCH,
    "transformer": _z_image(dim=3840, heads=30, layers=30, refiners=2, caption=2560),
    "text_encoder": {**_qwen3(2560, 36, 32, 8, 128, 9728), "vocab_size": 151936},
    "weights_dtype": "float16",
    "weights_for": ["transformer", "text_encoder"],
}


# FLUX.2 klein: Flux2Transformer2DModel (4 rotary axes T, H, W, L; no biases, no pooled projection, no guidance
# embedding), FLUX.2's VAE (32 latent channels, patchified to 128, batch-norm statistics) and Qwen3 read at
# layers 9, 18 and 27. The scheduler: FLUX.1-dev's config, which the pipeline's empirical mu shifts.
def _flux2(heads: int, head_dim: int, double: int, single: int, joint: int, guidance: bool = False) -> dict:
    """Flux2Transformer2DModel; its 4 rotary axes share the head dim equally."""
    return {"patch_size": 1, "in_channels": 128, "num_layers": double, "num_single_layers": single,
            "attention_head_dim": head_dim, "num_attention_heads": heads, "joint_attention_dim": joint,
            "timestep_guidance_channels": 256, "mlp_ratio": 3.0, "axes_dims_rope": [head_dim // 4] * 4,
            "rope_theta": 2000, "eps": 1e-06, "guidance_embeds": guidance}


_FLUX2_VAE = {"latent_channels": 32, "patch_size": [2, 2], "batch_norm_eps": 0.0001, "batch_norm_momentum": 0.1,
              "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
              "use_quant_conv": True, "use_post_quant_conv": True, "mid_block_add_attention": True}
_FLUX2_SCHEDULER = {**_FLUX_DEV_SCHEDULER, "time_shift_type": "exponential"}
# klein at tiny widths: head dim 64 (TensorRT's attention kernels want it), two heads, one double-stream block
# and one single-stream block (each more is traced again by every FLUX.2 graph the tests export); Qwen3 at tiny
# widths with 4 layers, read at 1, 2 and 3 (its config's `hidden_states_layers`: 28 layers to read klein's 9, 18
# and 27 take 100 s to export), so the graph stops before the last as klein's does.
FLUX2_KLEIN_TINY = {
    "transformer": _flux2(heads=2, head_dim=64, double=1, single=1, joint=3 * 32),
    "vae": {**_FLUX2_VAE, "block_out_channels": [8, 16, 16, 16], "layers_per_block": 1, "norm_num_groups": 4,
            "sample_size": 128},
    "text_encoder": {**_qwen3(32, 4, 2, 1, 16, 64), "hidden_states_layers": [1, 2, 3]},
    "vocab_pieces": 400,
    "scheduler": _FLUX2_SCHEDULER,
}
# klein's base checkpoints (FLUX.2-klein-base-4B): the same layout, not distilled (50 steps, CFG)
FLUX2_KLEIN_BASE_TINY = {**FLUX2_KLEIN_TINY, "is_distilled": False}
# klein's KV checkpoint (FLUX.2-klein-9b-kv: Flux2KleinKVPipeline): klein's layout, its references' keys and values
# computed on the first step and read on the others (export/families/flux2_kv.py)
FLUX2_KLEIN_KV_TINY = {**FLUX2_KLEIN_TINY, "pipeline_class": "Flux2KleinKVPipeline"}
# FLUX.2 dev (Flux2Pipeline): the transformer with its guidance embedding, and Mistral3 (Mistral Small 3.1) whose text
# path is read at layers 10, 20 and 30; at tiny widths its text path has 4 layers read at 1, 2 and 3, a one-layer
# Pixtral vision tower beside it (loaded, never run: the export keeps the text path), and its tokenizer pads on the
# left as Mistral's processor does.
FLUX2_DEV_TINY = {
    **FLUX2_KLEIN_TINY,
    "pipeline_class": "Flux2Pipeline",
    "transformer": _flux2(heads=2, head_dim=64, double=1, single=1, joint=3 * 32, guidance=True),
    "text_encoder": {"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "head_dim": 16, "intermediate_size": 64, "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0,
                     "max_position_embeddings": 131072, "sliding_window": None, "tie_word_embeddings": False,
                     "hidden_states_layers": [1, 2, 3]},
    "vision": {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32,
               "head_dim": 8, "patch_size": 14, "image_size": 56},
    "padding_side": "left",
}
_FLUX2_REAL_VAE = {**_FLUX2_VAE, "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2,
                   "norm_num_groups": 32, "sample_size": 1024}
# klein 4B's real widths (3072 = 24 heads of 128, text 3 x 2560) with 2 double-stream and 4 single-stream blocks;
# Qwen3-4B's widths at 4 layers read at 1, 2 and 3 (as klein's three layers side by side); the real VAE (benchmarks).
FLUX2_KLEIN_BENCH = {
    "transformer": _flux2(heads=24, head_dim=128, double=2, single=4, joint=3 * 2560),
    "vae": _FLUX2_REAL_VAE,
    "text_encoder": {**_qwen3(2560, 4, 32, 8, 128, 9728), "hidden_states_layers": [1, 2, 3]},
    "vocab_pieces": 1000,
    "scheduler": _FLUX2_SCHEDULER,
}
# klein's KV checkpoint at the same bench widths (the reference table: bench/tables/flux2_references.py)
FLUX2_KLEIN_KV_BENCH = {**FLUX2_KLEIN_BENCH, "pipeline_class": "Flux2KleinKVPipeline"}
# klein 9B at its true shapes (4096 = 32 heads of 128, 8 double + 24 single blocks, text 3 x 4096) and the whole
# Qwen3-8B (36 layers, read at 9, 18, 27; its 151936-token embedding), streamed in fp16 (make scale-check).
FLUX2_KLEIN_FULLSIZE = {
    **FLUX2_KLEIN_BENCH,
    "transformer": _flux2(heads=32, head_dim=128, double=8, single=24, joint=3 * 4096),
    "text_encoder": {**_qwen3(4096, 36, 32, 8, 128, 12288), "vocab_size": 151936, "tie_word_embeddings": False},
    "weights_dtype": "float16",
    "weights_for": ["transformer", "text_encoder"],
}



# Qwen-Image: QwenImageTransformer2DModel (MMDiT; its 3 rotary axes 16 + 56 + 56 of a head of 128), the causal 3D
# VAE (16 latent channels, per-channel mean and std: the config's defaults are Qwen-Image's), Qwen2.5-VL whose
# language model is read at its last layer. The scheduler: Qwen-Image's (dynamic shifting to 8192 tokens, a
# terminal shift).
def _qwen_image(heads: int, head_dim: int, layers: int, joint: int, axes: list[int]) -> dict:
    return {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": layers, "attention_head_dim": head_dim,
            "num_attention_heads": heads, "joint_attention_dim": joint, "guidance_embeds": False,
            "axes_dims_rope": axes}


def _qwen2_5_vl_text(width: int, layers: int, heads: int, kv_heads: int, mlp: int, mrope: list[int]) -> dict:
    return {"hidden_size": width, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "intermediate_size": mlp, "rms_norm_eps": 1e-06,
            "max_position_embeddings": 128000, "rope_scaling": {"type": "mrope", "mrope_section": mrope},
            "rope_theta": 1000000.0, "tie_word_embeddings": False}


_QWEN_IMAGE_SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True,
                         "base_shift": 0.5, "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192,
                         "shift_terminal": 0.02, "time_shift_type": "exponential"}
_QWEN_IMAGE_VAE = {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
                   "temperal_downsample": [False, True, True], "dropout": 0.0}
# Qwen2.5-VL's vision tower at tiny widths (loaded with the encoder, never run by text to image)
_QWEN_VL_VISION_TINY = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 14,
                        "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                        "fullatt_block_indexes": [0]}
# Tiny widths: two heads of 32 (rotary axes 8 + 12 + 12), two blocks; the VAE at base width 16 with one residual
# block a level; Qwen2.5-VL's language model at width 64 (heads of 16, mrope sections 2 + 3 + 3), 2 layers.
QWEN_IMAGE_TINY = {
    "transformer": _qwen_image(heads=2, head_dim=32, layers=2, joint=64, axes=[8, 12, 12]),
    "vae": {**_QWEN_IMAGE_VAE, "base_dim": 16, "num_res_blocks": 1},
    "text_encoder": _qwen2_5_vl_text(64, 2, 4, 2, 128, [2, 3, 3]),
    "vision": {**_QWEN_VL_VISION_TINY, "out_hidden_size": 64},
    "vocab_pieces": 400,
    "scheduler": _QWEN_IMAGE_SCHEDULER,
}

# Qwen-Image's real widths (3072 = 24 heads of 128, rotary axes 16 + 56 + 56, text 3584) with 2 blocks; Qwen2.5-VL-7B's
# language model at its real widths (3584, 28 heads, 4 key-value heads, 18944, mrope 16 + 24 + 24) at 2 layers;
# the real VAE (benchmarks)
QWEN_IMAGE_BENCH = {
    "transformer": _qwen_image(heads=24, head_dim=128, layers=2, joint=3584, axes=[16, 56, 56]),
    "vae": _QWEN_IMAGE_VAE,
    "text_encoder": _qwen2_5_vl_text(3584, 2, 28, 4, 18944, [16, 24, 24]),
    "vision": {**_QWEN_VL_VISION_TINY, "out_hidden_size": 3584},
    "vocab_pieces": 1000,
    "scheduler": _QWEN_IMAGE_SCHEDULER,
}

# Qwen-Image at its true shapes (60 blocks: 20.4 B parameters) and Qwen2.5-VL-7B's whole language model (28 layers,
# its 152064-token embedding; the vision tower, which text to image never runs, at bench widths). They get fp16
# weights drawn at export (`weights_drawn`): the folder and the export (41 GB each for the transformer) would not fit
# on the disk side by side (make scale-check).
QWEN_IMAGE_FULLSIZE = {
    **QWEN_IMAGE_BENCH,
    "transformer": _qwen_image(heads=24, head_dim=128, layers=60, joint=3584, axes=[16, 56, 56]),
    "text_encoder": {**_qwen2_5_vl_text(3584, 28, 28, 4, 18944, [16, 24, 24]), "vocab_size": 152064},
    "weights_dtype": "float16",
    "weights_for": ["transformer", "text_encoder"],
    "weights_drawn": True,
}
# Qwen-Image-Edit at tiny widths: qwen-image-tiny's with a vision tower of two blocks (the first attends within
# windows, the second over the whole image, as the real tower's 32 alternate) feeding the language model
QWEN_IMAGE_EDIT_TINY = {
    **QWEN_IMAGE_TINY,
    "vision": {**_QWEN_VL_VISION_TINY, "depth": 2, "fullatt_block_indexes": [1], "out_hidden_size": 64},
    "vocab_pieces": 800,  # the Edit template's 64-token system turn whole
    "pipeline_class": "QwenImageEditPipeline",
}
QWEN_IMAGE_EDIT_2511_TINY = {**QWEN_IMAGE_EDIT_TINY, "pipeline_class": "QwenImageEditPlusPipeline",
                             "transformer": {**QWEN_IMAGE_TINY["transformer"], "zero_cond_t": True}}
# Qwen-Image-Edit at qwen-image-bench's widths, with Qwen2.5-VL-7B's vision tower at its widths (1280 in 16 heads,
# 3420, into 3584) at 2 blocks (one windowed, one whole) (benchmarks)
QWEN_IMAGE_EDIT_BENCH = {
    **QWEN_IMAGE_BENCH,
    "vision": {**_QWEN_VL_VISION_TINY, "depth": 2, "fullatt_block_indexes": [1], "hidden_size": 1280,
               "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 3584},
    "pipeline_class": "QwenImageEditPipeline",
}
# The Edit pipelines' language-model sequence: the template, an input image's 1369 tokens at 1024 x 1024, the prompt
QWEN_IMAGE_EDIT_TEXT = (1, 1536, 2560)

# Qwen-Image 2.1: QwenImage21Transformer2DModel (single stream, block-causal; 32 heads of 128, rotary axes
# 16 + 56 + 56, no 2 x 2 patches: 64 latent channels a token), the RGBA VAE (AutoencoderKLQwenImage21: 16x, 64
# channels, per-channel mean and std), Qwen3-VL-8B (text 4096 in 36 layers, 32 heads and 8 key-value heads of 128,
# 12288, rope theta 5e6 with interleaved mrope 24 + 20 + 20; vision 1152 in 27 blocks, patches of 16, deepstack
# layers 8, 16, 24). The scheduler is Qwen-Image's.
def _qwen3_vl_text(width: int, layers: int, heads: int, kv_heads: int, head_dim: int, mlp: int,
                   mrope: list[int]) -> dict:
    return {"hidden_size": width, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim, "intermediate_size": mlp, "rms_norm_eps": 1e-06,
            "max_position_embeddings": 262144, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": mrope,
                                "mrope_interleaved": True}}


_QWEN3_VL_VISION = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "patch_size": 16,
                    "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 2304,
                    "deepstack_visual_indexes": [8, 16, 24], "out_hidden_size": 4096}
_QWEN_IMAGE_21_VAE = {"base_dim": 96, "decoder_base_dim": 144, "z_dim": 64, "dim_mult": [1, 2, 4, 8, 8],
                      "num_res_blocks": 2, "attn_scales": [], "temperal_downsample": [False, True, True, True],
                      "is_residual": True, "in_channels": 4, "out_channels": 4}
# Tiny widths: two heads of 32 (rotary axes 8 + 12 + 12), two blocks, 16 latent channels; the VAE's five levels
# (16x, as the pipeline fixes it) at base width 8, one residual block a level, the real statistics' first 16;
# Qwen3-VL's language model at width 64 (heads of 16, mrope 2 + 3 + 3), 2 layers; its vision tower at one block.
QWEN_IMAGE_21_TINY = {
    "transformer": {"patch_size": 1, "in_channels": 16, "out_channels": 16, "num_layers": 2, "attention_head_dim": 32,
                    "num_attention_heads": 2, "context_in_dim": 64, "mlp_ratio": 3, "axes_dims_rope": [8, 12, 12]},
    "vae": {**_QWEN_IMAGE_21_VAE, "base_dim": 8, "decoder_base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 2, 2, 2],
            "num_res_blocks": 1, "latents_mean": [0.5126, 0.7721, -0.0631, 1.3506, -0.7855, -2.1025, -0.3458, 1.3722,
                                                  1.8873, -1.7177, -0.651, 0.2732, 0.7562, -0.6163, -1.0277, 3.8363],
            "latents_std": [3.2001, 3.2936, 3.4321, 3.0091, 3.1061, 4.0379, 4.0705, 3.791, 3.0785, 3.65, 3.9308,
                            3.0904, 2.8778, 3.7675, 3.732, 5.0756]},
    "text_encoder": _qwen3_vl_text(64, 2, 4, 2, 16, 128, [2, 3, 3]),
    "vision": {**_QWEN3_VL_VISION, "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
               "num_position_embeddings": 64, "deepstack_visual_indexes": [0], "out_hidden_size": 64},
    "vocab_pieces": 400,
    "scheduler": _QWEN_IMAGE_SCHEDULER,
}

# Wan 2.1's configs (Wan-AI/Wan2.1-T2V-1.3B-Diffusers): the transformer's, its UMT5-XXL encoder's and its
# scheduler's (UniPC on flow sigmas, shift 3)
def _wan(heads: int, head_dim: int, ffn: int, layers: int, text: int) -> dict:
    return {"patch_size": [1, 2, 2], "num_attention_heads": heads, "attention_head_dim": head_dim, "in_channels": 16,
            "out_channels": 16, "text_dim": text, "freq_dim": 256, "ffn_dim": ffn, "num_layers": layers,
            "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-06, "image_dim": None,
            "added_kv_proj_dim": None, "rope_max_seq_len": 1024}


def _umt5(width: int, head_dim: int, heads: int, mlp: int, layers: int) -> dict:
    return {"d_model": width, "d_kv": head_dim, "d_ff": mlp, "num_layers": layers, "num_heads": heads,
            "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32,
            "relative_attention_max_distance": 128, "is_encoder_decoder": False, "use_cache": False}


_WAN_SCHEDULER = {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "num_train_timesteps": 1000,
                  "flow_shift": 3.0}
_WAN_VAE = {"z_dim": 16, "dim_mult": [1, 2, 4, 4], "attn_scales": [], "temperal_downsample": [False, True, True]}
WAN_TINY = {
    # head_dim 24: Wan's rotary split (frames 8, height 8, width 8 of it) at a tiny width
    "transformer": _wan(heads=2, head_dim=24, ffn=64, layers=2, text=32),
    "vae": {**_WAN_VAE, "base_dim": 8, "num_res_blocks": 1},
    "text_encoder": _umt5(32, 8, 4, 64, 2),
    "t5_vocab_pieces": 1000,
    "scheduler": _WAN_SCHEDULER,
}

# Wan 2.1 1.3B's real widths (12 heads of 128, feed-forward 8960, text 4096) at 2 blocks; UMT5-XXL's real widths
# (4096, 64 heads of 64, 10240) at 2 layers; Wan 2.1's real VAE (base 96, 2 residual blocks a level): benchmarks
WAN_BENCH = {
    "transformer": _wan(heads=12, head_dim=128, ffn=8960, layers=2, text=4096),
    "vae": {**_WAN_VAE, "base_dim": 96, "num_res_blocks": 2},
    "text_encoder": _umt5(4096, 64, 64, 10240, 2),
    "t5_vocab_pieces": 1000,
    "scheduler": _WAN_SCHEDULER,
}
# Wan 2.1 14B's transformer at its true shapes (40 heads of 128, feed-forward 13824, 40 blocks), random fp16 weights;
# the other components as configs only (make scale-check)
WAN_FULLSIZE = {**WAN_BENCH, "transformer": _wan(heads=40, head_dim=128, ffn=13824, layers=40, text=4096),
                "weights_dtype": "float16", "weights_for": ["transformer"]}
# Wan 2.2 A14B's layout: a second (low-noise) transformer below the boundary (its model_index.json's 0.875)
WAN22_A14B_TINY = {**WAN_TINY, "transformer_2": WAN_TINY["transformer"], "boundary_ratio": 0.875}
# Wan 2.1 I2V's layout (Wan-AI/Wan2.1-I2V-14B-480P-Diffusers): the transformer reads the image's mask (4) and
# latents (16) as more input channels, and CLIP ViT-H/14's penultimate states (image_dim 1280) through keys and values
# of their own in each cross-attention (added_kv_proj_dim: the inner width); CLIPImageProcessor at 224 with CLIP's
# mean and std. The image encoder at tiny widths keeps ViT-H/14's patches (257 tokens).
_CLIP_IMAGE_PROCESSOR = {"size": {"shortest_edge": 224}, "crop_size": {"height": 224, "width": 224},
                         "do_resize": True, "do_center_crop": True, "do_rescale": True, "do_normalize": True,
                         "do_convert_rgb": True, "resample": 3, "rescale_factor": 1 / 255,
                         "image_mean": [0.48145466, 0.4578275, 0.40821073],
                         "image_std": [0.26862954, 0.26130258, 0.27577711]}
WAN21_I2V_TINY = {
    **WAN_TINY,
    "transformer": {**WAN_TINY["transformer"], "in_channels": 36, "image_dim": 32, "added_kv_proj_dim": 48},
    "image_encoder": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                      "image_size": 224, "patch_size": 14, "hidden_act": "gelu", "projection_dim": 32},
    "image_processor": _CLIP_IMAGE_PROCESSOR,
}
# Wan 2.2 I2V A14B's layout (Wan-AI/Wan2.2-I2V-A14B-Diffusers): Wan 2.1 I2V's image channels in both transformers,
# no image encoder, the handover at its model_index.json's boundary 0.9
_WAN_I2V_TRANSFORMER = {**WAN_TINY["transformer"], "in_channels": 36}
WAN22_I2V_A14B_TINY = {**WAN_TINY, "transformer": _WAN_I2V_TRANSFORMER, "transformer_2": _WAN_I2V_TRANSFORMER,
                       "boundary_ratio": 0.9}
# Wan 2.2's VAE statistics (its config's latents_mean and latents_std, 48 channels)
_WAN22_LATENTS_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891, 0.157,
    -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502, -0.2055, -0.0322,
    0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.123, -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.052,
    0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667]
_WAN22_LATENTS_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.499, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165,
    0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659, 0.7069, 0.5338, 0.4889, 0.4917,
    0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.06,
    0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744]
# Wan 2.2 TI2V-5B's layout (Wan-AI/Wan2.2-TI2V-5B-Diffusers): a timestep per token (model_index.json's
# expand_timesteps), 48 latent channels, its VAE's residual blocks on 2 x 2 patches (4 x 16 x 16 compression; the real
# one: base 160, decoder 256, 2 residual blocks a level) and UniPC shifted by 5
WAN22_TI2V_TINY = {
    **WAN_TINY,
    "transformer": {**WAN_TINY["transformer"], "in_channels": 48, "out_channels": 48},
    "vae": {**_WAN_VAE, "z_dim": 48, "base_dim": 8, "decoder_base_dim": 8, "num_res_blocks": 1, "is_residual": True,
            "in_channels": 12, "out_channels": 12, "patch_size": 2, "scale_factor_spatial": 16,
            "latents_mean": _WAN22_LATENTS_MEAN, "latents_std": _WAN22_LATENTS_STD},
    "scheduler": {**_WAN_SCHEDULER, "flow_shift": 5.0},
    "expand_timesteps": True,
}

# LTX-Video's configs (Lightricks/LTX-Video-0.9.5): the 2B transformer's (32 heads of 64, cross-attention 2048,
# captions from T5-XXL's 4096, 128 latent channels, patches of one latent pixel), the 0.9.5 VAE's layout (spatial
# and temporal down blocks, 32x8 compression, a timestep-conditioned decoder that injects no noise) and 0.9.1's
# scheduler (shifted by the clip's tokens, stretched to a terminal 0.1; 0.9.5's is unshifted).
def _ltx(heads: int, head_dim: int, layers: int, text: int) -> dict:
    return {"in_channels": 128, "out_channels": 128, "patch_size": 1, "patch_size_t": 1,
            "num_attention_heads": heads, "attention_head_dim": head_dim, "cross_attention_dim": heads * head_dim,
            "num_layers": layers, "activation_fn": "gelu-approximate", "qk_norm": "rms_norm_across_heads",
            "norm_elementwise_affine": False, "norm_eps": 1e-06, "caption_channels": text, "attention_bias": True,
            "attention_out_bias": True}


def _ltx_vae(widths: list[int], decoder_widths: list[int], layers: int) -> dict:
    return {"in_channels": 3, "out_channels": 3, "latent_channels": 128, "block_out_channels": widths,
            "down_block_types": ["LTXVideo095DownBlock3D"] * 4,
            "downsample_type": ["spatial", "temporal", "spatiotemporal", "spatiotemporal"],
            "layers_per_block": [layers] * 5, "spatio_temporal_scaling": [True] * 4,
            "decoder_block_out_channels": decoder_widths, "decoder_layers_per_block": [layers] * 4,
            "decoder_spatio_temporal_scaling": [True] * 3, "decoder_inject_noise": [False] * 4,
            "upsample_residual": [True] * 3, "upsample_factor": [2] * 3, "timestep_conditioning": True,
            "patch_size": 4, "patch_size_t": 1, "resnet_norm_eps": 1e-06, "scaling_factor": 1.0,
            "encoder_causal": True, "decoder_causal": False, "spatial_compression_ratio": 32,
            "temporal_compression_ratio": 8}


_LTX_SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.95,
                  "max_shift": 2.05, "base_image_seq_len": 1024, "max_image_seq_len": 4096, "shift_terminal": 0.1}
LTX_TINY = {
    # inner width 64: the rotary tables' padding (64 % 6 = 4 channels, as 13B's 4096) at a tiny width
    "transformer": _ltx(heads=2, head_dim=32, layers=2, text=32),
    "vae": _ltx_vae([8, 16, 32, 64, 128], [16, 32, 64], layers=1),  # widths doubling as the real ones
    "text_encoder": _t5(32, 8, 4, 64),
    "t5_vocab_pieces": 1000,
    "scheduler": _LTX_SCHEDULER,
}
# LTX-Video 2B's real widths (32 heads of 64, captions of 4096) at 2 of its 28 blocks; T5-XXL's (4096, 64 heads of 64,
# 10240) at 2 layers; 0.9.0's real VAE (Lightricks/LTX-Video's vae/config.json: the decoder mirrors the encoder, no
# decode timestep): benchmarks. 0.9.0's, not 0.9.5's: optimum-intel 2.2 exports its VAE encoder from a 2-frame example,
# which 0.9.5's temporal downsampler cannot take (the peers run this model's export).
LTX_BENCH = {
    "transformer": _ltx(heads=32, head_dim=64, layers=2, text=4096),
    "vae": {"in_channels": 3, "out_channels": 3, "latent_channels": 128, "block_out_channels": [128, 256, 512, 512],
            "layers_per_block": [4, 3, 3, 3, 4], "decoder_block_out_channels": [128, 256, 512, 512],
            "decoder_layers_per_block": [4, 3, 3, 3, 4], "spatio_temporal_scaling": [True, True, True, False],
            "decoder_spatio_temporal_scaling": [True, True, True, False], "patch_size": 4, "patch_size_t": 1,
            "encoder_causal": True, "decoder_causal": False, "scaling_factor": 1.0, "resnet_norm_eps": 1e-06},
    "text_encoder": _t5(4096, 64, 64, 10240),
    "t5_vocab_pieces": 1000,
    "scheduler": _LTX_SCHEDULER,
}

MODELS: dict[str, ModelEntry] = {
    e.name: e
    for e in (
        ModelEntry("sd3", "sd3", hub_id="stabilityai/stable-diffusion-3-medium-diffusers",
                   description="Stable Diffusion 3 medium"),
        ModelEntry("sd3.5-medium", "sd3", hub_id="stabilityai/stable-diffusion-3.5-medium",
                   description="Stable Diffusion 3.5 medium"),
        ModelEntry("sd3.5-large", "sd3", hub_id="stabilityai/stable-diffusion-3.5-large",
                   description="Stable Diffusion 3.5 large"),
        ModelEntry("sd15", "sd15", hub_id="stable-diffusion-v1-5/stable-diffusion-v1-5", image_size=(256, 512, 768),
                   description="Stable Diffusion 1.5"),
        ModelEntry("sd15-inpaint", "sd15", hub_id="stable-diffusion-v1-5/stable-diffusion-inpainting",
                   image_size=(256, 512, 768), description="Stable Diffusion 1.5 inpainting (9-channel UNet)"),
        ModelEntry("sdxl", "sdxl", hub_id="stabilityai/stable-diffusion-xl-base-1.0", image_size=(512, 1024, 1536),
                   description="Stable Diffusion XL base 1.0"),
        ModelEntry("flux-dev", "flux", hub_id="black-forest-labs/FLUX.1-dev", image_size=(256, 1024, 1536),
                   description="FLUX.1 dev (guidance-distilled: 28 steps, guidance embedding 3.5)"),
        ModelEntry("flux-fill", "flux", hub_id="black-forest-labs/FLUX.1-Fill-dev", image_size=(256, 1024, 1536),
                   description="FLUX.1 Fill dev (inpainting and outpainting: 50 steps, guidance embedding 30)"),
        ModelEntry("flux-canny", "flux", hub_id="black-forest-labs/FLUX.1-Canny-dev", image_size=(256, 1024, 1536),
                   description="FLUX.1 Canny dev (an edge map's latents beside the latents: 50 steps, guidance 30 "
                               "on its model card)"),
        ModelEntry("flux-depth", "flux", hub_id="black-forest-labs/FLUX.1-Depth-dev", image_size=(256, 1024, 1536),
                   description="FLUX.1 Depth dev (a depth map's latents beside the latents: 30 steps, guidance 10 "
                               "on its model card)"),
        ModelEntry("flux-kontext", "flux", hub_id="black-forest-labs/FLUX.1-Kontext-dev", image_size=(256, 1024, 1536),
                   description="FLUX.1 Kontext dev (edits a reference image: 28 steps, guidance 2.5 on its model "
                               "card)"),
        ModelEntry("flux-schnell", "flux", hub_id="black-forest-labs/FLUX.1-schnell", image_size=(256, 1024, 1536),
                   description="FLUX.1 schnell (timestep-distilled: 4 steps, no guidance)"),
        ModelEntry("sd3-tiny", "sd3", random_configs=SD3_TINY, image_size=(64, 128, 512),
                   description="SD3 architecture at tiny widths, random seeded weights, built offline"),
        ModelEntry("sd3.5-tiny", "sd3", random_configs=SD35_TINY, image_size=(64, 128, 512),
                   description="SD3.5-medium architecture (q/k RMS norm, dual attention) at tiny widths, built offline"),
        ModelEntry("sd3-bench", "sd3", random_configs=SD3_BENCH, image_size=(256, 1024, 1024), batch=(1, 2, 4),
                   description="SD3-medium widths, 2 layers per stack, random seeded weights (benchmarks)"),
        ModelEntry("sd3-fullsize", "sd3", random_configs=SD3_FULLSIZE, image_size=(256, 1024, 1024), batch=(1, 2, 4),
                   export_dtype="float16",
                   description="SD3-medium at its true shapes, random weights streamed in fp16 (make scale-check)"),
        ModelEntry("sd3.5-large-transformer", "sd3", random_configs=SD35_LARGE_TRANSFORMER,
                   image_size=(256, 1024, 1024), batch=(1, 2, 4), export_dtype="float16",
                   description="SD3.5-large's transformer alone at its true shapes, random fp16 weights (make scale-check)"),
        ModelEntry("flux-tiny", "flux", random_configs=FLUX_TINY, image_size=(64, 128, 512), text_length=(1, 64, 512),
                   description="FLUX.1-dev architecture (guidance embedding) at tiny widths, built offline"),
        ModelEntry("flux-fill-tiny", "flux", random_configs=FLUX_FILL_TINY, image_size=(64, 128, 512),
                   text_length=(1, 64, 512),
                   description="FLUX.1 Fill architecture (inpainting: 384 input channels) at tiny widths, built offline"),
        ModelEntry("flux-control-tiny", "flux", random_configs=FLUX_CONTROL_TINY, image_size=(64, 128, 512),
                   text_length=(1, 64, 512),
                   description="FLUX.1 Canny/Depth architecture (a control image's latents: 128 input channels) at "
                               "tiny widths, built offline"),
        ModelEntry("flux-kontext-tiny", "flux", random_configs=FLUX_KONTEXT_TINY, image_size=(64, 128, 512),
                   text_length=(1, 64, 512),
                   description="FLUX.1 Kontext architecture (a reference image's tokens after the image's) at tiny "
                               "widths, built offline"),
        ModelEntry("flux-schnell-tiny", "flux", random_configs=FLUX_SCHNELL_TINY, image_size=(64, 128, 512),
                   text_length=(1, 64, 512),
                   description="FLUX.1-schnell architecture (no guidance embedding, no shift) at tiny widths, built offline"),
        ModelEntry("flux-bench", "flux", random_configs=FLUX_BENCH, image_size=(256, 1024, 1024), batch=(1, 2, 4),
                   description="FLUX.1 widths, 2 double + 4 single blocks, 2 T5 layers, random weights (benchmarks)"),
        ModelEntry("flux-fullsize", "flux", random_configs=FLUX_FULLSIZE, image_size=(256, 1024, 1024),
                   batch=(1, 2, 4), export_dtype="float16",
                   description="FLUX.1-dev's transformer at its true shapes, random fp16 weights (make scale-check)"),
        ModelEntry("z-image-turbo", "z_image", hub_id="Tongyi-MAI/Z-Image-Turbo", image_size=(256, 1024, 2048),
                   text_length=(1, 128, 512), extra={"variant": "turbo"},
                   description="Z-Image-Turbo (distilled: 8 steps, no guidance)"),
        ModelEntry("z-image", "z_image", hub_id="Tongyi-MAI/Z-Image", image_size=(256, 1024, 2048),
                   text_length=(1, 128, 512), description="Z-Image, the base model (50 steps, CFG)"),
        ModelEntry("z-image-tiny", "z_image", random_configs=Z_IMAGE_TINY, image_size=(64, 128, 512),
                   text_length=(1, 64, 512), extra={"variant": "turbo"},
                   description="Z-Image-Turbo architecture (Qwen3 encoder) at tiny widths, built offline"),
        ModelEntry("z-image-bench", "z_image", random_configs=Z_IMAGE_BENCH, image_size=(256, 1024, 1024),
                   text_length=(1, 128, 512), batch=(1, 2, 4), extra={"variant": "turbo"},
                   description="Z-Image widths, 2 layers and 1 refiner of each kind, Qwen3-4B's widths at 3 layers, "
                               "random weights (benchmarks)"),
        ModelEntry("z-image-fullsize", "z_image", random_configs=Z_IMAGE_FULLSIZE, image_size=(256, 1024, 1024),
                   text_length=(1, 128, 512), batch=(1, 2, 4), extra={"variant": "turbo"}, export_dtype="float16",
                   description="Z-Image-Turbo's transformer and Qwen3-4B at their true shapes, random fp16 weights "
                               "(make scale-check)"),
        ModelEntry("flux2-klein-4b", "flux2", hub_id="black-forest-labs/FLUX.2-klein-4B", image_size=(256, 1024, 1536),
                   description="FLUX.2 klein 4B (distilled: 4 steps, no guidance; Qwen3-4B encoder)"),
        ModelEntry("flux2-klein-9b", "flux2", hub_id="black-forest-labs/FLUX.2-klein-9B", image_size=(256, 1024, 1536),
                   description="FLUX.2 klein 9B (distilled: 4 steps, no guidance; Qwen3-8B encoder)"),
        ModelEntry("flux2-klein-base-4b", "flux2", hub_id="black-forest-labs/FLUX.2-klein-base-4B",
                   image_size=(256, 1024, 1536), description="FLUX.2 klein base 4B (50 steps, CFG)"),
        ModelEntry("flux2-klein-tiny", "flux2", random_configs=FLUX2_KLEIN_TINY, image_size=(64, 128, 512),
                   text_length=(1, 64, 512),
                   description="FLUX.2 klein architecture (distilled; Qwen3 of 4 layers read at 1, 2, 3) at tiny "
                               "widths, built offline"),
        ModelEntry("flux2-klein-base-tiny", "flux2", random_configs=FLUX2_KLEIN_BASE_TINY, image_size=(64, 128, 512),
                   text_length=(1, 64, 512),
                   description="FLUX.2 klein base architecture (CFG) at tiny widths, built offline"),
        ModelEntry("flux2-klein-9b-kv", "flux2", hub_id="black-forest-labs/FLUX.2-klein-9b-kv",
                   image_size=(256, 1024, 1536), extra={"variant": "kv"},
                   description="FLUX.2 klein 9B KV (distilled; the references' keys and values computed once)"),
        ModelEntry("flux2-klein-kv-tiny", "flux2", random_configs=FLUX2_KLEIN_KV_TINY, image_size=(64, 128, 512),
                   text_length=(1, 64, 512),
                   description="FLUX.2 klein KV architecture (references' keys and values cached) at tiny widths, "
                               "built offline"),
        ModelEntry("flux2-dev", "flux2", hub_id="black-forest-labs/FLUX.2-dev", image_size=(256, 1024, 1536),
                   description="FLUX.2 dev (50 steps, guidance embedding 4; Mistral Small 3.1 encoder)"),
        ModelEntry("flux2-dev-tiny", "flux2", random_configs=FLUX2_DEV_TINY, image_size=(64, 128, 512),
                   text_length=(1, 64, 512),
                   description="FLUX.2 dev architecture (guidance embedding; Mistral3 of 4 layers read at 1, 2, 3) at "
                               "tiny widths, built offline"),
        ModelEntry("flux2-klein-bench", "flux2", random_configs=FLUX2_KLEIN_BENCH, image_size=(256, 1024, 1024),
                   text_length=(1, 512, 512), batch=(1, 2, 4),
                   description="FLUX.2 klein 4B widths, 2 double + 4 single blocks, Qwen3-4B's widths at 4 layers, "
                               "the real VAE, random weights (benchmarks)"),
        ModelEntry("flux2-klein-kv-bench", "flux2", random_configs=FLUX2_KLEIN_KV_BENCH, image_size=(256, 1024, 1024),
                   text_length=(1, 512, 512), batch=(1, 2, 4),
                   description="flux2-klein-bench as FLUX.2 klein KV (the references' keys and values cached), "
                               "random weights (benchmarks)"),
        ModelEntry("flux2-klein-fullsize", "flux2", random_configs=FLUX2_KLEIN_FULLSIZE, image_size=(256, 1024, 1024),
                   text_length=(1, 512, 512), batch=(1, 2, 4), export_dtype="float16",
                   description="FLUX.2 klein 9B's transformer and Qwen3-8B at their true shapes, random fp16 weights "
                               "(make scale-check)"),
        ModelEntry("qwen-image", "qwen_image", hub_id="Qwen/Qwen-Image", image_size=(256, 1024, 1536),
                   text_length=(1, 128, 1058),
                   description="Qwen-Image (50 steps, true CFG 4 with a negative prompt; Qwen2.5-VL-7B encoder)"),
        ModelEntry("qwen-image-tiny", "qwen_image", random_configs=QWEN_IMAGE_TINY, image_size=(64, 128, 256),
                   text_length=(1, 64, 256),
                   description="Qwen-Image architecture (Qwen2.5-VL encoder, causal 3D VAE) at tiny widths, built "
                               "offline"),
        ModelEntry("qwen-image-bench", "qwen_image", random_configs=QWEN_IMAGE_BENCH, image_size=(256, 1024, 1024),
                   text_length=(1, 128, 1058), batch=(1, 2, 4),
                   description="Qwen-Image widths, 2 blocks, Qwen2.5-VL-7B's language model at 2 layers, the real VAE, "
                               "random weights (benchmarks)"),
        ModelEntry("qwen-image-fullsize", "qwen_image", random_configs=QWEN_IMAGE_FULLSIZE,
                   image_size=(256, 1024, 1024), text_length=(1, 128, 1058), batch=(1, 2, 4), export_dtype="float16",
                   description="Qwen-Image's 20 B transformer and Qwen2.5-VL-7B's language model at their true shapes, "
                               "random fp16 weights drawn at export (make scale-check)"),
        ModelEntry("qwen-image-edit", "qwen_image_edit", hub_id="Qwen/Qwen-Image-Edit", image_size=(256, 1024, 1536),
                   text_length=QWEN_IMAGE_EDIT_TEXT,
                   description="Qwen-Image-Edit (an input image and an instruction; 50 steps, true CFG 4 with a "
                               "negative prompt)"),
        ModelEntry("qwen-image-edit-2509", "qwen_image_edit", hub_id="Qwen/Qwen-Image-Edit-2509",
                   image_size=(256, 1024, 1536), text_length=QWEN_IMAGE_EDIT_TEXT,
                   description="Qwen-Image-Edit-2509 (QwenImageEditPlusPipeline: one to three input images)"),
        ModelEntry("qwen-image-edit-bench", "qwen_image_edit", random_configs=QWEN_IMAGE_EDIT_BENCH,
                   image_size=(256, 1024, 1536), text_length=QWEN_IMAGE_EDIT_TEXT, batch=(1, 2, 4),
                   description="Qwen-Image-Edit widths, 2 blocks, Qwen2.5-VL-7B's language model at 2 layers and its "
                               "vision tower at 2 blocks, the real VAE, random weights (benchmarks)"),
        ModelEntry("qwen-image-edit-2511", "qwen_image_edit", hub_id="Qwen/Qwen-Image-Edit-2511",
                   image_size=(256, 1024, 1536), text_length=QWEN_IMAGE_EDIT_TEXT,
                   description="Qwen-Image-Edit-2511 (QwenImageEditPlusPipeline; its input images modulated at "
                               "timestep 0: zero_cond_t)"),
        ModelEntry("qwen-image-edit-tiny", "qwen_image_edit", random_configs=QWEN_IMAGE_EDIT_TINY,
                   image_size=(64, 128, 256), text_length=(1, 256, 1024), extra={"image_area": 192 * 192},
                   description="Qwen-Image-Edit architecture (Qwen2.5-VL's vision tower and language model) at tiny "
                               "widths, built offline; its input images are sized to 192 x 192 pixels' area, not "
                               "1024 x 1024's, for its tests' time"),
        ModelEntry("qwen-image-edit-plus-tiny", "qwen_image_edit",
                   random_configs={**QWEN_IMAGE_EDIT_TINY, "pipeline_class": "QwenImageEditPlusPipeline"},
                   image_size=(64, 128, 256), text_length=(1, 256, 1024), extra={"image_area": 192 * 192},
                   description="qwen-image-edit-tiny as Qwen-Image-Edit-2509's QwenImageEditPlusPipeline (several "
                               "input images)"),
        ModelEntry("qwen-image-edit-2511-tiny", "qwen_image_edit", random_configs=QWEN_IMAGE_EDIT_2511_TINY,
                   image_size=(64, 128, 256), text_length=(1, 256, 1024), extra={"image_area": 192 * 192},
                   description="qwen-image-edit-plus-tiny with Qwen-Image-Edit-2511's zero_cond_t transformer"),
        ModelEntry("qwen-image-2.1", "qwen_image21", hub_id="Qwen/Qwen-Image-2.1", image_size=(256, 1024, 1536),
                   text_length=(1, 128, 1024),
                   description="Qwen-Image 2.1 (text to image; 40 steps, no guidance by default; Qwen3-VL-8B encoder, "
                               "RGBA images)"),
        ModelEntry("qwen-image-2.1-tiny", "qwen_image21", random_configs=QWEN_IMAGE_21_TINY, image_size=(64, 128, 256),
                   text_length=(1, 64, 256), extra={"image_area": 128 * 128},
                   description="Qwen-Image 2.1 architecture (Qwen3-VL encoder, block-causal transformer, RGBA VAE) at "
                               "tiny widths, built offline"),
        ModelEntry("wan2.1-t2v-1.3b", "wan", hub_id="Wan-AI/Wan2.1-T2V-1.3B-Diffusers", image_size=(256, 832, 1280),
                   frames=(5, 81, 81), text_length=(1, 128, 512), batch=(1, 2, 4),
                   description="Wan 2.1 text to video, 1.3B (480p; UMT5-XXL encoder)"),
        ModelEntry("wan2.1-t2v-14b", "wan", hub_id="Wan-AI/Wan2.1-T2V-14B-Diffusers", image_size=(256, 832, 1280),
                   frames=(5, 81, 81), text_length=(1, 128, 512), batch=(1, 2, 4),
                   description="Wan 2.1 text to video, 14B (480p and 720p; UMT5-XXL encoder)"),
        ModelEntry("wan-tiny", "wan", random_configs=WAN_TINY, image_size=(64, 64, 256), frames=(1, 9, 17),
                   text_length=(1, 64, 512),
                   description="Wan 2.1 architecture (UMT5 encoder, causal 3D VAE) at tiny widths, built offline"),
        ModelEntry("wan-bench", "wan", random_configs=WAN_BENCH, image_size=(128, 480, 832), frames=(5, 33, 81),
                   text_length=(1, 128, 512), batch=(1, 2, 2),
                   description="Wan 2.1 1.3B's widths at 2 blocks, UMT5-XXL's at 2 layers, the real VAE, random "
                               "weights (benchmarks)"),
        ModelEntry("wan-fullsize", "wan", random_configs=WAN_FULLSIZE, image_size=(256, 480, 832), frames=(5, 81, 81),
                   text_length=(1, 512, 512), batch=(1, 2, 2), export_dtype="float16",
                   description="Wan 2.1 14B's transformer at its true shapes, random fp16 weights (make scale-check)"),
        ModelEntry("wan2.2-t2v-a14b", "wan", hub_id="Wan-AI/Wan2.2-T2V-A14B-Diffusers", image_size=(256, 832, 1280),
                   frames=(5, 81, 81), text_length=(1, 128, 512), batch=(1, 2, 4),
                   description="Wan 2.2 text to video, A14B (two 14B transformers: high noise, then low noise)"),
        ModelEntry("wan22-tiny", "wan", random_configs=WAN22_A14B_TINY, image_size=(64, 64, 256), frames=(1, 9, 17),
                   text_length=(1, 64, 512),
                   description="Wan 2.2 A14B architecture (two transformers handing over at the boundary) at tiny "
                               "widths, built offline"),
        ModelEntry("wan2.1-i2v-14b-480p", "wan", hub_id="Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
                   image_size=(256, 480, 832), frames=(5, 81, 81), text_length=(1, 128, 512), batch=(1, 2, 4),
                   description="Wan 2.1 image to video, 14B at 480p (UMT5-XXL and CLIP ViT-H/14 encoders)"),
        ModelEntry("wan21-i2v-tiny", "wan", random_configs=WAN21_I2V_TINY, image_size=(64, 64, 256),
                   frames=(1, 9, 17), text_length=(1, 64, 512),
                   description="Wan 2.1 I2V architecture (the image as channels, a CLIP vision encoder) at tiny "
                               "widths, built offline"),
        ModelEntry("wan2.2-i2v-a14b", "wan", hub_id="Wan-AI/Wan2.2-I2V-A14B-Diffusers", image_size=(256, 832, 1280),
                   frames=(5, 81, 81), text_length=(1, 128, 512), batch=(1, 2, 4),
                   description="Wan 2.2 image to video, A14B (the image as channels of two 14B transformers: high "
                               "noise, then low noise)"),
        ModelEntry("wan22-i2v-tiny", "wan", random_configs=WAN22_I2V_A14B_TINY, image_size=(64, 64, 256),
                   frames=(1, 9, 17), text_length=(1, 64, 512),
                   description="Wan 2.2 I2V A14B architecture (the image as channels, two transformers handing over "
                               "at the boundary) at tiny widths, built offline"),
        ModelEntry("wan2.2-ti2v-5b", "wan", hub_id="Wan-AI/Wan2.2-TI2V-5B-Diffusers", image_size=(256, 704, 1280),
                   frames=(5, 121, 121), text_length=(1, 128, 512), batch=(1, 2, 4), extra={"fps": 24},
                   description="Wan 2.2 text and image to video, 5B (720p at 24 fps; a timestep per token, a 4x16x16 "
                               "VAE)"),
        ModelEntry("wan22-ti2v-tiny", "wan", random_configs=WAN22_TI2V_TINY, image_size=(64, 64, 256),
                   frames=(1, 9, 17), text_length=(1, 64, 512), extra={"fps": 24},
                   description="Wan 2.2 TI2V-5B architecture (a timestep per token, 48-channel latents, the 4x16x16 "
                               "VAE) at tiny widths, built offline"),
        ModelEntry("ltx-video", "ltx", hub_id="Lightricks/LTX-Video-0.9.5", image_size=(256, 512, 1024),
                   frames=(9, 161, 257), text_length=(1, 128, 256), batch=(1, 2, 4),
                   description="LTX-Video 0.9.5 text and image to video (2B; T5-XXL encoder)"),
        ModelEntry("ltx-bench", "ltx", random_configs=LTX_BENCH, image_size=(128, 512, 704), frames=(9, 41, 161),
                   text_length=(1, 128, 256), batch=(1, 2, 2),
                   description="LTX-Video 2B's widths at 2 blocks, T5-XXL's at 2 layers, 0.9.0's real VAE, random "
                               "weights (benchmarks)"),
        ModelEntry("ltx-video-tiny", "ltx", random_configs=LTX_TINY, image_size=(64, 64, 256), frames=(9, 17, 25),
                   text_length=(1, 128, 128),
                   description="LTX-Video architecture (T5 encoder, 0.9.5's VAE, 0.9.1's shifted schedule) at tiny "
                               "widths, built offline"),
        ModelEntry("sd15-tiny", "sd15", random_configs=SD15_TINY, image_size=(64, 128, 256),
                   description="SD1.5 architecture at tiny widths, random seeded weights, built offline"),
        ModelEntry("sd15-inpaint-tiny", "sd15", random_configs=SD15_INPAINT_TINY, image_size=(64, 128, 256),
                   description="SD1.5 inpainting architecture (9-channel UNet) at tiny widths, built offline"),
        ModelEntry("sdxl-tiny", "sdxl", random_configs=SDXL_TINY, image_size=(64, 128, 256),
                   description="SDXL architecture at tiny widths, random seeded weights, built offline"),
        ModelEntry("sd15-bench", "sd15", random_configs=SD15_BENCH, image_size=(256, 512, 512), batch=(1, 2, 4),
                   description="the real SD1.5 architecture, random seeded weights (benchmarks)"),
    )
}
