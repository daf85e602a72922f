"""What each pass must find in a pipeline, computed from the model's configs (the test oracle)."""
from __future__ import annotations


def expected_counts(submodule: str, cfg: dict, outputs: tuple[str, ...] = ()) -> dict[str, dict[str, int]]:
    """{pass name: {count: value}} for `fuse_qkv`, `fuse_attention` and `fuse_elementwise` on one
    submodule; `outputs` are its graph's outputs (a CLIP read only at its penultimate layer
    exports without its last one)."""
    if submodule in ("text_encoder", "text_encoder_2") and set(outputs) == {"penultimate_hidden_states"}:
        cfg = {**cfg, "num_hidden_layers": cfg["num_hidden_layers"] - 1}
    return {**_fusions(submodule, cfg), "fuse_elementwise": {"silus": _silus(submodule, cfg)}}


def unet_blocks(cfg: dict) -> tuple[int, int]:
    """(transformer blocks, resnets) of a UNet2DConditionModel config, counted as diffusers builds
    them: up blocks have one layer more than down blocks and take the transformer depths reversed;
    the mid block has two resnets and the last depth."""
    n, layers = len(cfg["block_out_channels"]), cfg["layers_per_block"]
    depth = cfg.get("transformer_layers_per_block", 1)
    depth = [depth] * n if isinstance(depth, int) else list(depth)
    down = sum(layers * d for b, d in zip(cfg["down_block_types"], depth) if b.startswith("CrossAttn"))
    up = sum((layers + 1) * d for b, d in zip(cfg["up_block_types"], depth[::-1]) if b.startswith("CrossAttn"))
    return down + up + depth[-1], n * layers + n * (layers + 1) + 2


def shallow_blocks(cfg: dict) -> tuple[int, int]:
    """(transformer blocks, resnets) of DeepCache's shallow branch (export/families/deep_cache.py): the last
    layer of the last up block, which takes the first transformer depth."""
    depth = cfg.get("transformer_layers_per_block", 1)
    first = depth if isinstance(depth, int) else depth[0]
    return (first if cfg["up_block_types"][-1].startswith("CrossAttn") else 0), 1


def _silus(submodule: str, cfg: dict) -> int:
    """SiLUs and quick GELUs: two per VAE resnet and one before conv_out; the transformer's timestep
    and pooled-text embedders and the silu(temb) its adaLN layers share; CLIP's quick GELU per layer;
    in a UNet two per resnet, the silu(temb) they share, the time embedding's, SDXL's added
    embedding's, and one before conv_out."""
    if submodule in ("vae_decoder", "vae_encoder"):
        per_block = cfg["layers_per_block"] + (submodule == "vae_decoder")
        return 2 * (2 + len(cfg["block_out_channels"]) * per_block) + 1
    if submodule in ("transformer", "transformer_first_block"):
        return 3
    if submodule in ("unet", "unet_shallow"):
        resnets = (unet_blocks if submodule == "unet" else shallow_blocks)(cfg)[1]
        return 2 * resnets + 3 + (cfg.get("addition_embed_type") == "text_time")
    if submodule in ("text_encoder", "text_encoder_2"):
        return cfg["num_hidden_layers"] if cfg["hidden_act"] == "quick_gelu" else 0
    return 0  # T5: ReLU or GELU


def _first_block(cfg: dict) -> dict:
    """The First-Block Cache's graph holds the transformer's embeddings, block 0 and its output
    layers: the transformer's counts at one layer."""
    return {**cfg, "num_layers": 1, "dual_attention_layers": [i for i in cfg.get("dual_attention_layers") or () if i == 0]}


def _fusions(submodule: str, cfg: dict) -> dict[str, dict[str, int]]:
    if submodule == "transformer_first_block":
        return _fusions("transformer", _first_block(cfg))
    if submodule == "transformer":
        layers, dual = cfg["num_layers"], len(cfg.get("dual_attention_layers") or ())
        # Per block: image q/k/v, context q/k/v, and q/k/v of the second attention where present.
        # One more group: every block's two adaLN projections and norm_out's read the same silu(temb).
        return {"fuse_qkv": {"groups": 2 * layers + dual + 1, "projections_fused": 6 * layers + 3 * dual + 2 * layers + 1},
                "fuse_attention": {"attentions_fused": layers + dual}}
    if submodule in ("unet", "unet_shallow"):
        # q/k/v of every self-attention; the k and v of every cross-attention all read the text
        # embedding: one group; every resnet's time projection reads the same silu(temb): one more
        # (a group needs two projections).
        transformers, resnets = (unet_blocks if submodule == "unet" else shallow_blocks)(cfg)
        cross, times = transformers > 0, resnets > 1
        return {"fuse_qkv": {"groups": transformers + cross + times, "projections_fused": 5 * transformers + resnets * times},
                "fuse_attention": {"attentions_fused": 2 * transformers}}
    if submodule in ("text_encoder", "text_encoder_2"):  # CLIP: q/k/v per layer
        layers = cfg["num_hidden_layers"]
        return {"fuse_qkv": {"groups": layers, "projections_fused": 3 * layers},
                "fuse_attention": {"attentions_fused": layers}}
    if submodule == "text_encoder_3":  # T5: q/k/v per layer, and wi_0/wi_1 of the gated FFN
        layers, gated = cfg["num_layers"], cfg["feed_forward_proj"].startswith("gated")
        return {"fuse_qkv": {"groups": layers * (1 + gated), "projections_fused": layers * (3 + 2 * gated)},
                "fuse_attention": {"attentions_fused": layers}}
    if submodule in ("vae_decoder", "vae_encoder"):  # the mid block's single-head attention
        return {"fuse_qkv": {"groups": 1, "projections_fused": 3}, "fuse_attention": {"attentions_fused": 1}}
    raise KeyError(submodule)
