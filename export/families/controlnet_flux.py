"""Flux's ControlNets (diffusers' FluxControlNetModel, as FluxControlNetPipeline runs them).

A Flux ControlNet is a shorter Flux transformer: its k double-stream and k' single-stream blocks each give
a residual for the image stream. diffusers' transformer adds double residual i // ceil(N / k) after its
double block i, and single residual j // ceil(M / k') after its single block j (N and M blocks). As for
SD3 (controlnet_sd3.py), the transformer takes one residual input per block (`double_residual_i`,
`single_residual_j`) only when exported with ControlNets, and the runner hands each ControlNet's
residuals to the blocks by that rule.

The engine returns its k + k' residuals times `conditioning_scale` (one factor each). It reads the control
image as packed VAE latents (the runner encodes them), and the guidance scale where it embeds one.
A ControlNet-Union (`num_mode`, InstantX's and Shakker-Labs' Union ones) also reads the control mode of
its image (`controlnet_mode`: which kind of control image it is, canny, depth, ...), embedded as one more
text token. XLabs' ControlNets (`conditioning_embedding_channels`) encode the control image themselves (an
image hint encoder), so their engine reads it in pixels, and their k residuals repeat over the double
blocks (block i adds residual i % k; they have no single-stream blocks): diffusers'
`controlnet_blocks_repeat`, which the constant of that name tells the runner. One export takes ControlNets
of one of the two kinds, as diffusers' pipeline decides for all of them from the first."""
from __future__ import annotations

import torch

from export.families.first_block import HIDDEN, inner_dim
from export.families.flux import controlled_transformer, exact_timesteps, export_rope
from export.random_weights import redraw
from export.spec import ControlNetKind, SubmoduleSpec, TensorSpec as T

# The transformer's settings a ControlNet must share with it, to read its inputs and add to its stream
_SHARED = ("in_channels", "joint_attention_dim", "pooled_projection_dim", "axes_dims_rope")


class _FluxControlNet(torch.nn.Module):
    def __init__(self, controlnet):
        super().__init__()
        self.controlnet = controlnet
        export_rope(controlnet.pos_embed)

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids, *rest):
        config, rest = self.controlnet.config, list(rest)
        guidance = rest.pop(0) if config.guidance_embeds else None
        mode = rest.pop(0) if config.num_mode is not None else None
        controlnet_cond, conditioning_scale = rest
        with exact_timesteps(self.controlnet, timestep, guidance):
            double, single = self.controlnet(hidden_states=hidden_states, controlnet_cond=controlnet_cond,
                                             controlnet_mode=mode, encoder_hidden_states=encoder_hidden_states,
                                             pooled_projections=pooled_projections, timestep=timestep,
                                             img_ids=img_ids, txt_ids=txt_ids, guidance=guidance, return_dict=False)
        samples = [*(double or ()), *(single or ())]
        return tuple(s * conditioning_scale[i] for i, s in enumerate(samples))


def _encodes_image(config: dict) -> bool:
    """XLabs' kind: an image hint encoder of its own, which reads the control image in pixels."""
    return config.get("conditioning_embedding_channels") is not None


def _spec(config: dict) -> SubmoduleSpec:
    double, single = config["num_layers"], config["num_single_layers"]
    guidance = (T("guidance", "float32", ("batch",), high=10),) if config.get("guidance_embeds") else ()
    mode = (T("controlnet_mode", "int64", ("batch", 1), high=config["num_mode"]),) \
        if config.get("num_mode") is not None else ()
    return SubmoduleSpec(
        name="controlnet",
        component="controlnet",
        inputs=(
            T("hidden_states", "float32", ("batch", "image_tokens", "packed_channels")),
            T("encoder_hidden_states", "float32", ("batch", "text_length", "joint_dim")),
            T("pooled_projections", "float32", ("batch", "pooled_dim")),
            T("timestep", "float32", ("batch",), high=1),
            T("img_ids", "float32", ("image_tokens", 3), high=64),
            T("txt_ids", "float32", ("text_length", 3), high=64),
            *guidance,
            *mode,
            T("controlnet_cond", "float32", ("batch", 3, "image_height", "image_width") if _encodes_image(config)
              else ("batch", "image_tokens", "packed_channels")),
            T("conditioning_scale", "float32", (double + single,), high=2),
        ),
        outputs=(*(T(f"controlnet_block_{j}", "float32", HIDDEN) for j in range(double)),
                 *(T(f"controlnet_single_block_{j}", "float32", HIDDEN) for j in range(single))),
        wrap=_FluxControlNet,
        latent_divisor="latent_multiple",  # a packed token's side
        # Run at every step as the transformer is, and quantized as it is (its embedders kept in float).
        quantization={"denoiser": True, "keep_scopes": ("x_embedder", "controlnet_x_embedder", "time_text_embed",
                                                        "context_embedder"),
                      "fp32_scopes": ("time_text_embed",), "fp32_inputs": ("timestep", "guidance")},
    )


def _check(config: dict, base, given: str) -> None:
    from export.source import SourceError

    transformer = base.config("transformer")
    shared = {**{k: transformer.get(k) for k in _SHARED}, "inner_dim": inner_dim(transformer)}
    theirs = {**{k: config.get(k) for k in _SHARED}, "inner_dim": inner_dim(config)}
    for key, value in shared.items():
        if theirs[key] != value:
            raise SourceError(f"controlnet {given} has {key}={theirs[key]}; {base.entry.name}'s transformer has "
                              f"{value}: pass a ControlNet trained for this base model")
    if base.model_index().get("_class_name") == "FluxKontextPipeline":
        raise SourceError(f"controlnet {given}: {base.entry.name} is FLUX.1 Kontext; ControlNets run with "
                          "FluxPipeline's transformer (diffusers' FluxControlNetPipeline)")


def _constants(configs: list[dict], base) -> dict:
    from export.source import SourceError

    transformer = base.config("transformer")
    if len({_encodes_image(c) for c in configs}) > 1:
        raise SourceError("these ControlNets mix XLabs' kind (conditioning_embedding_channels: it encodes the control "
                          "image itself) with the kind that reads VAE latents; diffusers runs one kind at a time: "
                          "export them separately")
    return {"double_layers": transformer["num_layers"], "single_layers": transformer["num_single_layers"],
            "controlnet_blocks_repeat": int(_encodes_image(configs[0])),
            # each ControlNet's number of control modes, 0 for one of one condition (the runner checks control_mode=)
            "control_modes": [c.get("num_mode") or 0 for c in configs]}


def _build_random(base, seed: int, out, num_mode: int | None = None,
                  conditioning_embedding_channels: int | None = None) -> None:
    """FluxControlNetModel.from_transformer of the base's transformer, one double-stream and one
    single-stream block deep, with seeded random weights in its zero-initialised control embedding and
    output projections (zero ones would change nothing, and a test could not tell). `num_mode`: a
    ControlNet-Union of that many control modes. `conditioning_embedding_channels`: one of XLabs' kind,
    with its image hint encoder, two double-stream blocks and no single-stream ones, as theirs."""
    from diffusers import FluxControlNetModel, FluxTransformer2DModel

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel.from_pretrained(base.folder / "transformer")
    config = transformer.config
    if num_mode is not None:  # from_transformer reads the transformer's config, which has none
        transformer.register_to_config(num_mode=num_mode)
    controlnet = FluxControlNetModel.from_transformer(transformer, num_layers=1, num_single_layers=1,
                                                      attention_head_dim=config.attention_head_dim,
                                                      num_attention_heads=config.num_attention_heads)
    if conditioning_embedding_channels is not None:  # seeded weights of its own (its blocks are not the transformer's)
        controlnet = FluxControlNetModel.from_config({
            **controlnet.config, "num_layers": 2, "num_single_layers": 0,
            "conditioning_embedding_channels": conditioning_embedding_channels})
    hint = [controlnet.input_hint_block.conv_out] if controlnet.input_hint_block is not None else []
    redraw([*controlnet.controlnet_blocks, *controlnet.controlnet_single_blocks, controlnet.controlnet_x_embedder,
            *hint], seed)
    controlnet.save_pretrained(out, safe_serialization=True)


KINDS = {"flux": ControlNetKind(class_name="FluxControlNetModel", check=_check, spec=_spec, constants=_constants,
                                build_random=_build_random, controlled=controlled_transformer)}
