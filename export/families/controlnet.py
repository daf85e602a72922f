"""ControlNets of the U-Net families (diffusers' ControlNetModel), exported beside a model as engines
`controlnet`, `controlnet_1`, ...: those a ControlNet pipeline folder holds (a MultiControlNetModel
saves as controlnet/, controlnet_1/, ...), then those given with `python -m export MODEL --controlnet
FOLDER_OR_HUB_ID` (a folder or hub id of a ControlNetModel, or a random test one of `TINY_CONTROLNETS`).

A ControlNet engine returns its residuals already scaled: `conditioning_scale` holds one factor per
residual (the user's scale, times diffusers' guess-mode ramp from 0.1 to 1 where it applies), so one
graph serves every scale and mode. Its outputs are named as the UNet's residual inputs."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from export.families.unet import LAYOUTS, SDXL_ADDED, has_layout, residual_specs
from export.registry import ModelEntry
from export.spec import SubmoduleSpec, TensorSpec as T
from runners.manifest import digest, write_once

COMPONENT = "controlnet"
# Random-weight ControlNets for tests: {name: (base model, seed)}. ControlNetModel.from_unet of the base
# model's UNet (its widths and, as diffusers' training starts, its weights), with seeded random output
# convolutions in place of the zero ones from_unet gives (zero ones would change nothing, and a test
# could not tell); two of SD1.5's differ by their seed, for tests of two ControlNets.
TINY_CONTROLNETS = {"sd15-controlnet-tiny": ("sd15-tiny", 0), "sd15-controlnet-tiny-2": ("sd15-tiny", 1),
                    "sdxl-controlnet-tiny": ("sdxl-tiny", 0)}


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
        name=COMPONENT,
        component=COMPONENT,
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
        # Run at every step as the UNet is, and quantized as it is.
        quantization={"denoiser": True, "keep_scopes": ("conv_in", "time_proj", "time_embedding", "add_time_proj",
                                                        "add_embedding", "controlnet_cond_embedding")},
    )


SPECS = {"sd15": _spec("sd15"), "sdxl": _spec("sdxl", *SDXL_ADDED)}


def engine_name(index: int) -> str:
    return COMPONENT if index == 0 else f"{COMPONENT}_{index}"


def pipeline_controlnets(src) -> list[Path]:
    """The ControlNet folders of a ControlNet pipeline folder: controlnet/, controlnet_1/, ..."""
    if not src.has(COMPONENT):
        return []
    folders = []
    while (src.folder / engine_name(len(folders)) / "config.json").is_file():
        folders.append(src.folder / engine_name(len(folders)))
    return folders


def _random_folder(name: str) -> Path:
    """The random-weight ControlNet `name`, built once into the models cache from its base's UNet."""
    from diffusers import ControlNetModel, UNet2DConditionModel

    from export.source import cache_root, resolve
    from export.versions import package_versions

    base_name, seed = TINY_CONTROLNETS[name]
    base = resolve(base_name)
    key = digest([name, base.fingerprint, seed, Path(__file__).read_text(),
                  package_versions(("torch", "diffusers"))])

    def build(tmp: Path) -> None:
        torch.manual_seed(seed)  # from_unet draws the control image encoder's other layers from torch's generator
        controlnet = ControlNetModel.from_unet(UNet2DConditionModel.from_pretrained(base.folder / "unet"))
        generator = torch.Generator().manual_seed(seed)
        zero_convs = [*controlnet.controlnet_down_blocks, controlnet.controlnet_mid_block,
                      controlnet.controlnet_cond_embedding.conv_out]
        with torch.no_grad():
            for conv in zero_convs:
                fan_in = conv.weight[0].numel()
                conv.weight.copy_(torch.randn(conv.weight.shape, generator=generator) / fan_in ** 0.5)
                conv.bias.copy_(torch.randn(conv.bias.shape, generator=generator) * 0.1)
        controlnet.save_pretrained(tmp, safe_serialization=True)

    return write_once(cache_root() / "models" / f"{name}-{key}", "config.json", build)


def _folder_of(given: str) -> Path:
    """A TINY_CONTROLNETS name, a local folder, or a hub id -> the ControlNet's folder."""
    from export.source import local_or_hub

    return _random_folder(given) if given in TINY_CONTROLNETS else local_or_hub(given, "--controlnet", TINY_CONTROLNETS)


def controlnet_source(folder: Path, given: str, base):
    """The ControlNet in `folder` as a ModelSource of one component (`controlnet`), checked against
    the base model `base` (its family's UNet layout, widths and text width)."""
    from export.source import ModelSource, SourceError, _folder_fingerprint, cache_root

    config_path = folder / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if config.get("_class_name") != "ControlNetModel":
        raise SourceError(f"controlnet {given}: {folder} holds no ControlNetModel (its config.json names "
                          f"{config.get('_class_name')!r}); pass a diffusers ControlNetModel folder or hub id")
    family = base.family.name
    if family not in SPECS:
        raise SourceError(f"controlnet {given}: {family} models take no ControlNet here (U-Net families: "
                          f"{', '.join(SPECS)})")
    if not has_layout(base, family):
        raise SourceError(f"controlnet {given}: {base.entry.name}'s UNet is not laid out as {family}'s real ones "
                          f"({LAYOUTS[family][0]} down blocks of {LAYOUTS[family][1]}), so it has no residual inputs")
    unet = base.config("unet")
    for key in ("block_out_channels", "cross_attention_dim", "layers_per_block"):
        if config.get(key) != unet[key]:
            raise SourceError(f"controlnet {given} has {key}={config.get(key)}; {base.entry.name}'s UNet has "
                              f"{unet[key]}: pass a ControlNet trained for this base model")
    if config.get("global_pool_conditions"):
        raise SourceError(f"controlnet {given} pools its conditions globally (global_pool_conditions), which is "
                          "not supported: use a ControlNet without it")
    fingerprint = _folder_fingerprint(folder)
    staged = cache_root() / "controlnets" / f"{folder.name}-{fingerprint}"  # as a one-component pipeline

    def stage(tmp: Path) -> None:
        (tmp / COMPONENT).symlink_to(folder, target_is_directory=True)  # no copy of its weights
        (tmp / "model_index.json").write_text(json.dumps({"_class_name": "ControlNetModel",
                                                          COMPONENT: ["diffusers", "ControlNetModel"]}))

    write_once(staged, "model_index.json", stage)
    entry = ModelEntry(name=str(given), family=COMPONENT, description=f"ControlNet {given}")
    return ModelSource(entry, staged, fingerprint)


def controlnet_sources(base, given: list[str]) -> list:
    """The base's own ControlNets (a ControlNet pipeline folder's), then those `given`."""
    folders = [(f, f"{base.entry.name}/{f.name}") for f in pipeline_controlnets(base)]
    folders += [(_folder_of(g), g) for g in given]
    return [controlnet_source(folder, name, base) for folder, name in folders]


def specs_and_constants(family: str, sources: list) -> tuple[list[SubmoduleSpec], dict]:
    """One spec per ControlNet (engines controlnet, controlnet_1, ...) and the constant they add."""
    channels = {s.config(COMPONENT).get("conditioning_channels", 3) for s in sources}
    if len(channels) > 1:
        raise ValueError(f"the ControlNets take control images of {sorted(channels)} channels: one export takes "
                         "ControlNets of one kind of control image")
    specs = [dataclasses.replace(SPECS[family], name=engine_name(i)) for i in range(len(sources))]
    return specs, ({"conditioning_channels": channels.pop()} if sources else {})
