"""ControlNets, exported beside a model as engines `controlnet`, `controlnet_1`, ...: those a ControlNet
pipeline folder holds (a MultiControlNetModel saves as controlnet/, controlnet_1/, ...), then those given
with `python -m export MODEL --controlnet FOLDER_OR_HUB_ID` (a folder or hub id of a ControlNet, or a
random test one of `RANDOM_CONTROLNETS`).

What differs per family is its ControlNet kind, one module each: the U-Nets' (controlnet_unet.py), SD3's
(controlnet_sd3.py), Flux's (controlnet_flux.py), Z-Image's (controlnet_z_image.py) and Qwen-Image's
(controlnet_qwen_image.py). A family without one in
`KINDS` takes no ControlNet."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import NamedTuple

from export.families import (controlnet_flux, controlnet_qwen_image, controlnet_sd3, controlnet_unet,
                             controlnet_z_image)
from export.registry import ModelEntry
from export.spec import ControlNetKind, SubmoduleSpec
from runners.manifest import digest, write_once

COMPONENT = "controlnet"
KINDS: dict[str, ControlNetKind] = {**controlnet_unet.KINDS, **controlnet_sd3.KINDS, **controlnet_flux.KINDS,
                                    **controlnet_z_image.KINDS, **controlnet_qwen_image.KINDS}


class RandomControlNet(NamedTuple):
    """A random-weight ControlNet for tests and benchmarks, made by its base family's kind."""

    base: str  # the registry model it is made for
    seed: int  # two of SD1.5's differ by their seed only, for runs of two ControlNets
    options: tuple[tuple[str, object], ...] = ()  # the kind's build_random keywords (SD3's inpainting one)


RANDOM_CONTROLNETS = {
    "sd15-controlnet-tiny": RandomControlNet("sd15-tiny", 0),
    "sd15-controlnet-tiny-2": RandomControlNet("sd15-tiny", 1),
    "sdxl-controlnet-tiny": RandomControlNet("sdxl-tiny", 0),
    "sd3-controlnet-tiny": RandomControlNet("sd3-tiny", 0),
    "sd3-controlnet-inpaint-tiny": RandomControlNet("sd3-tiny", 0, (("extra_conditioning_channels", 1),)),
    "sd3-controlnet-large-tiny": RandomControlNet("sd3-tiny", 0, (("use_pos_embed", False),)),
    "flux-controlnet-tiny": RandomControlNet("flux-tiny", 0),
    "flux-controlnet-union-tiny": RandomControlNet("flux-tiny", 0, (("num_mode", 4),)),
    "flux-controlnet-xlabs-tiny": RandomControlNet("flux-tiny", 0, (("conditioning_embedding_channels", 16),)),
    "z-image-controlnet-tiny": RandomControlNet("z-image-tiny", 0),
    "z-image-controlnet-inpaint-tiny": RandomControlNet("z-image-tiny", 0, (("inpainting", True),)),
    "qwen-image-controlnet-tiny": RandomControlNet("qwen-image-tiny", 0),
    "qwen-image-controlnet-inpaint-tiny": RandomControlNet("qwen-image-tiny", 0, (("inpainting", True),)),
    "sd15-bench-controlnet": RandomControlNet("sd15-bench", 0),
    "sd15-bench-controlnet-2": RandomControlNet("sd15-bench", 1),
    "sd3-bench-controlnet": RandomControlNet("sd3-bench", 0),
    "flux-bench-controlnet": RandomControlNet("flux-bench", 0)}


def random_controlnets(model: str) -> list[str]:
    """The random ControlNets made for the registry model `model` that run together, in their order (those
    of other kinds, SD3's inpainting and SD3.5-Large-like ones and Flux's Union and XLabs' ones, made for
    their own tests, are left out)."""
    return [name for name, made in RANDOM_CONTROLNETS.items() if made.base == model and not made.options]


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
    """The random-weight ControlNet `name`, built once into the models cache from its base model."""
    from export.source import cache_root, resolve
    from export.versions import package_versions

    made = RANDOM_CONTROLNETS[name]
    base = resolve(made.base)
    kind = KINDS[base.family.name]
    code = [Path(module.__file__).read_text() for module in (sys.modules[__name__],
                                                              sys.modules[kind.build_random.__module__])]
    key = digest([name, base.fingerprint, made.seed, made.options, code, package_versions(("torch", "diffusers"))])

    def build(tmp: Path) -> None:
        kind.build_random(base, made.seed, tmp, **dict(made.options))

    return write_once(cache_root() / "models" / f"{name}-{key}", "config.json", build)


def folder_of(given: str) -> Path:
    """A RANDOM_CONTROLNETS name, a local folder, or a hub id -> the ControlNet's folder."""
    from export.source import local_or_hub

    if given in RANDOM_CONTROLNETS:
        return _random_folder(given)
    return local_or_hub(given, "--controlnet", RANDOM_CONTROLNETS)


def controlnet_source(folder: Path, given: str, base):
    """The ControlNet in `folder` as a ModelSource of one component (`controlnet`), checked against
    the base model `base` by its family's kind."""
    from export.source import ModelSource, SourceError, _folder_fingerprint, cache_root

    family = base.family.name
    if family not in KINDS:
        raise SourceError(f"controlnet {given}: {family} models take no ControlNet here (families that do: "
                          f"{', '.join(KINDS)})")
    kind = KINDS[family]
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if config.get("_class_name") != kind.class_name:
        raise SourceError(f"controlnet {given}: {folder} holds no {kind.class_name} (its config.json names "
                          f"{config.get('_class_name')!r}); {family} takes a diffusers {kind.class_name} folder or "
                          "hub id")
    kind.check(config, base, given)
    borrowed = kind.borrows(config)
    fingerprint = _folder_fingerprint(folder)
    if borrowed:
        fingerprint = digest([fingerprint, base.component_digest(borrowed)])
    staged = cache_root() / "controlnets" / f"{folder.name}-{fingerprint}"  # as a one-component pipeline

    def stage(tmp: Path) -> None:
        if borrowed:
            (tmp / COMPONENT).mkdir()
            kind.complete(config, folder, base, tmp / COMPONENT)
        else:
            (tmp / COMPONENT).symlink_to(folder, target_is_directory=True)  # no copy of its weights
        loader = kind.loader or ("diffusers", kind.class_name)
        (tmp / "model_index.json").write_text(json.dumps({"_class_name": kind.class_name, COMPONENT: list(loader)}))

    write_once(staged, "model_index.json", stage)
    entry = ModelEntry(name=str(given), family=COMPONENT, description=f"ControlNet {given}")
    return ModelSource(entry, staged, fingerprint)


def controlnet_sources(base, given: list[str]) -> list:
    """The base's own ControlNets (a ControlNet pipeline folder's), then those `given`."""
    folders = [(f, f"{base.entry.name}/{f.name}") for f in pipeline_controlnets(base)]
    folders += [(folder_of(g), g) for g in given]
    return [controlnet_source(folder, name, base) for folder, name in folders]


def with_controlnets(specs: list[SubmoduleSpec], base, sources: list) -> tuple[list, list, dict]:
    """(the base's submodule descriptions as exported beside the ControlNets, one description per
    ControlNet (engines controlnet, controlnet_1, ...), the constants they add)."""
    if not sources:
        return specs, [], {}
    kind = KINDS[base.family.name]
    configs = [s.config(COMPONENT) for s in sources]
    controls = [dataclasses.replace(kind.spec(config), name=engine_name(i)) for i, config in enumerate(configs)]
    replaced = {s.name: s for s in kind.controlled(base, configs)} if kind.controlled else {}
    return [replaced.get(s.name, s) for s in specs], controls, kind.constants(configs, base)
