"""SD3's ControlNets (diffusers' SD3ControlNetModel, as StableDiffusion3ControlNetPipeline runs them).

An SD3 ControlNet is a shorter MMDiT: its k blocks each give a residual for the image stream. diffusers'
transformer adds residual int(i / (N / k)) after each of its N blocks i but the last. Here the
transformer takes one residual input per such block (`block_residual_i`), and the runner hands each
ControlNet's outputs to the blocks by that rule: the transformer's graph does not depend on k, so one
graph serves ControlNets of any depth, several at once.

Unlike the UNet's real layouts, the transformer takes these inputs only when ControlNets are exported
with it (the first one added exports the transformer again): N - 1 residuals of the whole hidden stream
are zeros to add on a step without control.

The engine returns its k residuals times `conditioning_scale` (one factor per residual). The control
image reaches it as VAE latents (the runner encodes it), and where the ControlNet forces zero pooled
projections (`force_zeros_for_pooled_projection`, InstantX's) the graph makes those zeros itself."""
from __future__ import annotations

import torch

from export.families.first_block import HIDDEN, inner_dim
from export.families.sd3 import controlled_transformer, export_cropping
from export.random_weights import redraw
from export.spec import ControlNetKind, SubmoduleSpec, TensorSpec as T

# The transformer's settings a ControlNet must share with it, to read its inputs and add to its stream
_SHARED = ("in_channels", "patch_size", "pooled_projection_dim")


class _SD3ControlNet(torch.nn.Module):
    def __init__(self, controlnet):
        super().__init__()
        self.controlnet = controlnet
        export_cropping(controlnet.pos_embed)

    def forward(self, hidden_states, timestep, *inputs):
        config, inputs = self.controlnet.config, list(inputs)
        text = inputs.pop(0) if config.joint_attention_dim is not None else None
        pooled = hidden_states.new_zeros(hidden_states.shape[0], config.pooled_projection_dim) \
            if config.force_zeros_for_pooled_projection else inputs.pop(0)
        controlnet_cond, conditioning_scale = inputs
        samples = self.controlnet(hidden_states=hidden_states, controlnet_cond=controlnet_cond, timestep=timestep,
                                  encoder_hidden_states=text, pooled_projections=pooled, return_dict=False)[0]
        return tuple(s * conditioning_scale[i] for i, s in enumerate(samples))


def _spec(config: dict) -> SubmoduleSpec:
    layers = config["num_layers"]
    text = (T("encoder_hidden_states", "float32", ("batch", "joint_length", "joint_dim")),) \
        if config.get("joint_attention_dim") is not None else ()
    pooled = () if config.get("force_zeros_for_pooled_projection", True) else (
        T("pooled_projections", "float32", ("batch", "pooled_dim")),)
    return SubmoduleSpec(
        name="controlnet",
        component="controlnet",
        inputs=(
            T("hidden_states", "float32", ("batch", "in_channels", "latent_height", "latent_width")),
            T("timestep", "float32", ("batch",), high="num_train_timesteps"),
            *text,
            *pooled,
            T("controlnet_cond", "float32", ("batch", "latent_channels", "latent_height", "latent_width")),
            T("conditioning_scale", "float32", (layers,), high=2),
        ),
        outputs=tuple(T(f"controlnet_block_{j}", "float32", HIDDEN) for j in range(layers)),
        wrap=_SD3ControlNet,
        # Run at every step as the transformer is, and quantized as it is (its embedders kept in float).
        quantization={"denoiser": True, "keep_scopes": ("pos_embed", "pos_embed_input", "time_text_embed",
                                                        "context_embedder")},
    )


def _check(config: dict, base, given: str) -> None:
    from export.source import SourceError

    transformer = base.config("transformer")
    shared = {**{k: transformer[k] for k in _SHARED}, "inner_dim": inner_dim(transformer)}
    theirs = {**{k: config.get(k) for k in _SHARED}, "inner_dim": inner_dim(config)}
    if config.get("joint_attention_dim") is not None:
        shared["joint_attention_dim"], theirs["joint_attention_dim"] = (transformer["joint_attention_dim"],
                                                                          config["joint_attention_dim"])
    for key, value in shared.items():
        if theirs[key] != value:
            raise SourceError(f"controlnet {given} has {key}={theirs[key]}; {base.entry.name}'s transformer has "
                              f"{value}: pass a ControlNet trained for this base model")
    if not config.get("use_pos_embed", True):
        raise SourceError(f"controlnet {given} reads the latents through its base transformer's patch embedding "
                          "(use_pos_embed false: SD3.5 Large's ControlNets), which is not supported yet: use one with "
                          "its own (SD3-medium's, such as InstantX's)")
    if config.get("extra_conditioning_channels", 0):
        raise SourceError(f"controlnet {given} reads a mask beside the control image (extra_conditioning_channels, "
                          "StableDiffusion3ControlNetInpaintingPipeline's), which is not supported: use a ControlNet "
                          "without it")


def _constants(configs: list[dict], base) -> dict:
    return {"transformer_layers": base.config("transformer")["num_layers"]}


def _build_random(base, seed: int, out) -> None:
    """SD3ControlNetModel.from_transformer of the base's transformer, one block deep (real ones are
    shallower than their transformer too), with seeded random weights in its zero-initialised control
    image embedding and output projections (zero ones would change nothing, and a test could not tell)."""
    from diffusers import SD3ControlNetModel, SD3Transformer2DModel

    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel.from_pretrained(base.folder / "transformer")
    controlnet = SD3ControlNetModel.from_transformer(transformer, num_layers=1, num_extra_conditioning_channels=0)
    redraw([*controlnet.controlnet_blocks, controlnet.pos_embed_input.proj], seed)
    controlnet.save_pretrained(out, safe_serialization=True)


KINDS = {"sd3": ControlNetKind(class_name="SD3ControlNetModel", check=_check, spec=_spec, constants=_constants,
                               build_random=_build_random, controlled=controlled_transformer)}
