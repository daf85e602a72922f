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
image reaches it as VAE latents (the runner encodes it), and where the ControlNet takes zero pooled
projections the graph makes those zeros itself: where it forces them (`force_zeros_for_pooled_projection`,
InstantX's), and for an inpainting ControlNet, to which StableDiffusion3ControlNetInpaintingPipeline gives
them. An inpainting ControlNet (`extra_conditioning_channels`: 1, alimama's) reads the masked image's
latents and the mask beside them; those and the others run in different pipelines, so one export takes one
kind or the other. SD3.5 Large's ControlNets (`use_pos_embed` false, no text stream) read the latents
through their transformer's patch embedding: the export stages them with a copy of it, as diffusers'
pipeline gives them one."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from export.families.first_block import HIDDEN, inner_dim
from export.families.sd3 import controlled_transformer, export_cropping
from export.random_weights import redraw
from export.spec import ControlNetKind, SubmoduleSpec, TensorSpec as T

# The transformer's settings a ControlNet must share with it, to read its inputs and add to its stream
_SHARED = ("in_channels", "patch_size", "pooled_projection_dim")
WEIGHTS = "diffusion_pytorch_model.safetensors"


class _SD3ControlNet(torch.nn.Module):
    def __init__(self, controlnet):
        super().__init__()
        self.controlnet = controlnet
        export_cropping(controlnet.pos_embed)

    def forward(self, hidden_states, timestep, *inputs):
        config, inputs = self.controlnet.config, list(inputs)
        text = inputs.pop(0) if config.joint_attention_dim is not None else None
        pooled = hidden_states.new_zeros(hidden_states.shape[0], config.pooled_projection_dim) \
            if _zero_pooled(config) else inputs.pop(0)
        controlnet_cond, conditioning_scale = inputs
        samples = self.controlnet(hidden_states=hidden_states, controlnet_cond=controlnet_cond, timestep=timestep,
                                  encoder_hidden_states=text, pooled_projections=pooled, return_dict=False)[0]
        return tuple(s * conditioning_scale[i] for i, s in enumerate(samples))


def _masks(config) -> bool:
    """Whether the ControlNet inpaints: reads a mask beside the masked image's latents."""
    return bool(config.get("extra_conditioning_channels", 0))


def _zero_pooled(config) -> bool:
    """Whether the ControlNet's pipeline gives it zero pooled projections: its own setting, or always for an
    inpainting one (StableDiffusion3ControlNetInpaintingPipeline, unless called with others)."""
    return bool(config.get("force_zeros_for_pooled_projection", True)) or _masks(config)


def _spec(config: dict) -> SubmoduleSpec:
    layers = config["num_layers"]
    text = (T("encoder_hidden_states", "float32", ("batch", "joint_length", "joint_dim")),) \
        if config.get("joint_attention_dim") is not None else ()
    pooled = () if _zero_pooled(config) else (T("pooled_projections", "float32", ("batch", "pooled_dim")),)
    channels = config["in_channels"] + config["extra_conditioning_channels"] if _masks(config) else "latent_channels"
    return SubmoduleSpec(
        name="controlnet",
        component="controlnet",
        inputs=(
            T("hidden_states", "float32", ("batch", "in_channels", "latent_height", "latent_width")),
            T("timestep", "float32", ("batch",), high="num_train_timesteps"),
            *text,
            *pooled,
            T("controlnet_cond", "float32", ("batch", channels, "latent_height", "latent_width")),
            T("conditioning_scale", "float32", (layers,), high=2),
        ),
        outputs=tuple(T(f"controlnet_block_{j}", "float32", HIDDEN) for j in range(layers)),
        wrap=_SD3ControlNet,
        latent_divisor="latent_multiple",  # its patch, as the transformer's beside it (alone it measured right at 1)
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
    if config.get("extra_conditioning_channels", 0) not in (0, 1):
        raise SourceError(f"controlnet {given} reads {config['extra_conditioning_channels']} channels beside the "
                          "control image's latents; StableDiffusion3ControlNetInpaintingPipeline gives one (the mask)")


def _constants(configs: list[dict], base) -> dict:
    from export.source import SourceError

    if len({_masks(c) for c in configs}) > 1:
        raise SourceError("inpainting ControlNets (extra_conditioning_channels) and others run in different diffusers "
                          "pipelines: export them apart")
    return {"transformer_layers": base.config("transformer")["num_layers"], "control_masks": int(_masks(configs[0]))}


def _borrows(config) -> str | None:
    """SD3.5 Large's ControlNets (use_pos_embed false) run with their transformer's patch embedding."""
    return "transformer" if config.get("use_pos_embed", True) is False else None


def _complete(config: dict, folder: Path, base, out: Path) -> None:
    """A ControlNet that borrows its transformer's patch embedding, as one that has it: diffusers'
    StableDiffusion3ControlNetPipeline gives it a copy of the transformer's (_get_pos_embed_from_transformer).
    Its config says use_pos_embed, with the transformer's patch embedding settings; an index adds the
    embedding's weights (a file of their own) to the ControlNet's, whose files are linked (by names
    ending in .safetensors: a hub cache's real files are blobs named by their hash)."""
    from export.lazy_weights import copy_tensors, link_checkpoint

    own = link_checkpoint(folder, out)
    borrowed = copy_tensors(base.folder / "transformer", ("pos_embed.",), out / "pos_embed.safetensors")
    weight_map = own | dict.fromkeys(borrowed, "pos_embed.safetensors")
    index = {"metadata": {}, "weight_map": weight_map}
    (out / f"{WEIGHTS}.index.json").write_text(json.dumps(index))
    transformer = base.config("transformer")
    (out / "config.json").write_text(json.dumps({
        **config, "use_pos_embed": True, "pos_embed_type": "sincos",
        **{k: transformer[k] for k in ("sample_size", "pos_embed_max_size")}}))


def _build_random(base, seed: int, out, extra_conditioning_channels: int = 0, use_pos_embed: bool = True) -> None:
    """SD3ControlNetModel.from_transformer of the base's transformer, one block deep (real ones are
    shallower than their transformer too), with seeded random weights in its zero-initialised control
    image embedding and output projections (zero ones would change nothing, and a test could not tell).
    `extra_conditioning_channels` 1: an inpainting one; `use_pos_embed` False: one like SD3.5 Large's,
    without a patch embedding or text stream of its own (single-stream blocks)."""
    from diffusers import SD3ControlNetModel, SD3Transformer2DModel

    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel.from_pretrained(base.folder / "transformer")
    if use_pos_embed:
        controlnet = SD3ControlNetModel.from_transformer(transformer, num_layers=1,
                                                         num_extra_conditioning_channels=extra_conditioning_channels)
    else:
        controlnet = SD3ControlNetModel.from_config({
            **transformer.config, "num_layers": 1, "joint_attention_dim": None, "use_pos_embed": False,
            "pos_embed_type": None, "force_zeros_for_pooled_projection": False,
            "extra_conditioning_channels": extra_conditioning_channels})
    redraw([*controlnet.controlnet_blocks, controlnet.pos_embed_input.proj], seed)
    controlnet.save_pretrained(out, safe_serialization=True)


KINDS = {"sd3": ControlNetKind(class_name="SD3ControlNetModel", check=_check, spec=_spec, constants=_constants,
                               build_random=_build_random, controlled=controlled_transformer, borrows=_borrows,
                               complete=_complete)}
