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
    t5_length: tuple[int, int, int] = (1, 256, 512)
    description: str = ""
    extra: dict = field(default_factory=dict)


_SD3_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0}
_SD3_VAE = {  # the real SD3 VAE structure: 16 latent channels, 4 blocks (scale factor 8)
    "in_channels": 3, "out_channels": 3, "latent_channels": 16,
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "scaling_factor": 1.5305, "shift_factor": 0.0609,
    "use_quant_conv": False, "use_post_quant_conv": False,
}

# SD3-medium at tiny widths: CLIP-L (32) + CLIP-G (48) < T5 (96), pooled 32 + 48 = 80.
SD3_TINY = {
    "transformer": {
        "sample_size": 16, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 2,
        "attention_head_dim": 8, "num_attention_heads": 4, "joint_attention_dim": 96,
        "caption_projection_dim": 32, "pooled_projection_dim": 80, "pos_embed_max_size": 96,
    },
    "vae": {**_SD3_VAE, "block_out_channels": [8, 16, 16, 16], "layers_per_block": 1,
            "norm_num_groups": 4, "sample_size": 128},
    "text_encoder": {  # CLIP-L: quick_gelu
        "vocab_size": 49408, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 77, "projection_dim": 32,
        "hidden_act": "quick_gelu", "bos_token_id": 49406, "eos_token_id": 49407, "pad_token_id": 1,
    },
    "text_encoder_2": {  # CLIP-G: gelu
        "vocab_size": 49408, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 77, "projection_dim": 48,
        "hidden_act": "gelu", "bos_token_id": 49406, "eos_token_id": 49407, "pad_token_id": 1,
    },
    "text_encoder_3": {  # T5 v1.1 encoder: gated-gelu
        "d_model": 96, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 6,
        "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32,
        "relative_attention_max_distance": 128, "is_encoder_decoder": False, "use_cache": False,
    },
    "t5_vocab_pieces": 1000,
    "scheduler": _SD3_SCHEDULER,
}

# SD3-medium's real widths with 2 layers in the transformer and in each text encoder: the FLOPs
# per layer are real, and a whole pipeline runs in minutes on a 2-core CPU (benchmarks).
SD3_BENCH = {
    "transformer": {
        "sample_size": 128, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 2,
        "attention_head_dim": 64, "num_attention_heads": 24, "joint_attention_dim": 4096,
        "caption_projection_dim": 1536, "pooled_projection_dim": 2048, "pos_embed_max_size": 192,
    },
    "vae": {**_SD3_VAE, "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2,
            "norm_num_groups": 32, "sample_size": 1024},
    "text_encoder": {**SD3_TINY["text_encoder"], "hidden_size": 768, "intermediate_size": 3072,
                     "num_attention_heads": 12, "projection_dim": 768},
    "text_encoder_2": {**SD3_TINY["text_encoder_2"], "hidden_size": 1280, "intermediate_size": 5120,
                       "num_attention_heads": 20, "projection_dim": 1280},
    "text_encoder_3": {**SD3_TINY["text_encoder_3"], "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_heads": 64},
    "t5_vocab_pieces": 1000,
    "scheduler": _SD3_SCHEDULER,
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
        ModelEntry("sd3-tiny", "sd3", random_configs=SD3_TINY, image_size=(64, 128, 512),
                   description="SD3 architecture at tiny widths, random seeded weights, built offline"),
        ModelEntry("sd3-bench", "sd3", random_configs=SD3_BENCH, image_size=(256, 1024, 1024), batch=(1, 2, 4),
                   description="SD3-medium widths, 2 layers per stack, random seeded weights (benchmarks)"),
    )
}
