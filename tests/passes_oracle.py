"""What each pass must find in a pipeline, computed from the model's configs (the test oracle)."""
from __future__ import annotations


def expected_counts(submodule: str, cfg: dict) -> dict[str, dict[str, int]]:
    """{pass name: {count: value}} for `fuse_qkv` and `fuse_attention` on one submodule."""
    if submodule == "transformer":
        layers, dual = cfg["num_layers"], len(cfg.get("dual_attention_layers") or ())
        # Per block: image q/k/v, context q/k/v, and q/k/v of the second attention where present.
        # One more group: every block's two adaLN projections and norm_out's read the same silu(temb).
        return {"fuse_qkv": {"groups": 2 * layers + dual + 1, "projections_fused": 6 * layers + 3 * dual + 2 * layers + 1},
                "fuse_attention": {"attentions_fused": layers + dual}}
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
