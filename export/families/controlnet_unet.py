"""The U-Net families' ControlNets (diffusers' ControlNetModel, for SD1.x and SDXL).

The engine returns the UNet's residuals already scaled: `conditioning_scale` holds one factor per
residual (the user's scale, times diffusers' guess-mode ramp from 0.1 to 1 where it applies), so one
graph serves every scale and mode. Its outputs are named as the UNet's residual inputs, which every
UNet of its family's real layout has (export/families/unet.py)."""
from __future__ import annotations

import torch

from export.families.unet import LAYOUTS, SDXL_ADDED, has_layout, residual_specs
from export.random_weights import redraw
from export.spec import ControlNetKind, SubmoduleSpec, TensorSpec as T


class _ControlNet(torch.nn.Module):
    """Raw residuals (scale 1, no guess mode) times one factor each: diffusers' own scaling, as inputs."""

    def __init__(self, controlnet):
        super().__init__()
        self.controlnet = controlnet

    def forward(self, sample, timestep, encoder_hidden_states, controlnet_cond, conditioning_scale, *added):
        kwargs = {"added_cond_kwargs": {"text_embeds": added[0], "time_ids": added[1]}} if added else {}
        down, mid = self.controlnet(sample, timestep, encoder_hidden_states=encoder_hidden_states,
                                    controlnet_cond=controlnet_cond, return_dict=False, **kwargs)
        return tuple(r * conditioning_scale[i] for i, r in enumerate([*down, mid]))


def _spec(family: str, *added: T) -> SubmoduleSpec:
    residuals = residual_specs(*LAYOUTS[family])
    return SubmoduleSpec(
        name="controlnet",
        component="controlnet",
        inputs=(
            T("sample", "float32", ("batch", "latent_channels", "latent_height", "latent_width")),
            T("timestep", "float32", ("batch",), high="num_train_timesteps"),
            T("encoder_hidden_states", "float32", ("batch", "clip_length", "cross_dim")),
            T("controlnet_cond", "float32", ("batch", "conditioning_channels", "image_height", "image_width"), high=1),
            T("conditioning_scale", "float32", (len(residuals),), high=2),
            *added,
        ),
        outputs=residuals,
        wrap=_ControlNet,
        latent_divisor="latent_multiple",  # its U-Net's down blocks (_check: the same widths)
        # Run at every step as the UNet is, and quantized as it is.
        quantization={"denoiser": True, "keep_scopes": ("conv_in", "time_proj", "time_embedding", "add_time_proj",
                                                        "add_embedding", "controlnet_cond_embedding")},
    )


def _check(family: str):
    def check(config: dict, base, given: str) -> None:
        from export.source import SourceError

        if not has_layout(base, family):
            raise SourceError(f"controlnet {given}: {base.entry.name}'s UNet is not laid out as {family}'s real ones "
                              f"({LAYOUTS[family][0]} down blocks of {LAYOUTS[family][1]}), so it has no residual "
                              "inputs")
        unet = base.config("unet")
        for key in ("block_out_channels", "cross_attention_dim", "layers_per_block"):
            if config.get(key) != unet[key]:
                raise SourceError(f"controlnet {given} has {key}={config.get(key)}; {base.entry.name}'s UNet has "
                                  f"{unet[key]}: pass a ControlNet trained for this base model")
        if config.get("global_pool_conditions"):
            raise SourceError(f"controlnet {given} pools its conditions globally (global_pool_conditions), which is "
                              "not supported: use a ControlNet without it")
    return check


def _constants(configs: list[dict], base) -> dict:
    channels = {c.get("conditioning_channels", 3) for c in configs}
    if len(channels) > 1:
        raise ValueError(f"the ControlNets take control images of {sorted(channels)} channels: one export takes "
                         "ControlNets of one kind of control image")
    return {"conditioning_channels": channels.pop()}


def _build_random(base, seed: int, out) -> None:
    """ControlNetModel.from_unet of the base's UNet (its widths and, as diffusers' training starts, its
    weights), with seeded random output convolutions in place of the zero ones from_unet gives (zero
    ones would change nothing, and a test could not tell)."""
    from diffusers import ControlNetModel, UNet2DConditionModel

    torch.manual_seed(seed)  # from_unet draws the control image encoder's other layers from torch's generator
    controlnet = ControlNetModel.from_unet(UNet2DConditionModel.from_pretrained(base.folder / "unet"))
    redraw([*controlnet.controlnet_down_blocks, controlnet.controlnet_mid_block,
            controlnet.controlnet_cond_embedding.conv_out], seed)
    controlnet.save_pretrained(out, safe_serialization=True)


KINDS = {family: ControlNetKind(class_name="ControlNetModel", check=_check(family), spec=lambda config, s=spec: s,
                                constants=_constants, build_random=_build_random)
         for family, spec in (("sd15", _spec("sd15")), ("sdxl", _spec("sdxl", *SDXL_ADDED)))}
