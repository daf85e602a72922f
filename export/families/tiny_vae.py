"""The tiny autoencoder (diffusers' AutoencoderTiny: madebyollin's taesd, taesdxl, taesd3, taef1)
exported beside a model's own VAE as `vae_decoder_tiny` and `vae_encoder_tiny`
(`python -m export MODEL --tiny-vae FOLDER_OR_HUB_ID`). The runner decodes with it when loaded
with `vae="tiny"`, and draws live previews with it.

The tiny autoencoder comes as its own folder (config.json of an AutoencoderTiny and its weights),
a hub id of one, or a name of `TINY_VAES` (random weights, for tests). It is presented to the
export as a one-component pipeline (`vae_tiny`) so that the submodules export, stream their
weights and check their parity as every other does."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch

from export.families.parts import VAE_DECODER, VAE_ENCODER
from export.registry import ModelEntry
from runners.manifest import digest, write_once

COMPONENT = "vae_tiny"
_TINY_WIDTHS = {"encoder_block_out_channels": [8, 8, 8, 8], "decoder_block_out_channels": [8, 8, 8, 8],
                "num_encoder_blocks": [1, 1, 1, 1], "num_decoder_blocks": [1, 1, 1, 1]}
# The latent channels, scaling and shift factors of madebyollin's configs: taesd and taesdxl have 4
# channels and factors 1 and 0 (their latents are already the VAE's scaled ones); taesd3 and taef1 have
# 16 and SD3's and FLUX.1's VAE factors.
_FACTORS = {"taesd": (4, 1.0, 0.0), "taesdxl": (4, 1.0, 0.0), "taesd3": (16, 1.5305, 0.0609),
            "taef1": (16, 0.3611, 0.1159)}
# Random-weight tiny autoencoders with those factors: "-tiny" at tiny widths (tests), "-bench" at the real
# ones' architecture, AutoencoderTiny's defaults (benchmarks).
TINY_VAES = {f"{name}-{size}": {**widths, "latent_channels": c, "scaling_factor": scaling, "shift_factor": shift}
             for name, (c, scaling, shift) in _FACTORS.items()
             for size, widths in (("tiny", _TINY_WIDTHS), ("bench", {}))}
RANDOM_SEED = 0


class _TinyEncoder(torch.nn.Module):
    """Image in [-1, 1] -> latents (the tiny encoder is deterministic: no posterior to sample)."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, image):
        return (self.vae.encode(image, return_dict=False)[0],)


# The full VAE's tensors and decoder wrapper (decode(latent) -> image in [-1, 1]); no int8 activations.
DECODER = dataclasses.replace(VAE_DECODER, name="vae_decoder_tiny", component=COMPONENT, quantization={})
ENCODER = dataclasses.replace(VAE_ENCODER, name="vae_encoder_tiny", component=COMPONENT,
                              outputs=VAE_ENCODER.outputs[:1], wrap=_TinyEncoder)
ENCODER = dataclasses.replace(ENCODER, outputs=(dataclasses.replace(ENCODER.outputs[0], name="latent"),))
SPECS = (DECODER, ENCODER)


def _random_folder(name: str) -> Path:
    """The random-weight AutoencoderTiny of `name`, built once into the models cache."""
    from diffusers import AutoencoderTiny

    from export.source import cache_root
    from export.versions import package_versions

    # This file's code draws the weights: a change to it builds the folder anew.
    key = digest([TINY_VAES[name], RANDOM_SEED, Path(__file__).read_text(), package_versions(("torch", "diffusers"))])

    def build(tmp: Path) -> None:
        torch.manual_seed(RANDOM_SEED)
        vae = AutoencoderTiny(**TINY_VAES[name]).eval()
        _spread_output(vae)
        vae.save_pretrained(tmp, safe_serialization=True)

    return write_once(cache_root() / "models" / f"{name}-{key}", "config.json", build)


def _spread_output(vae) -> None:
    """Random weights decode to a nearly black image, which any two decoders agree on: the last
    convolution is rescaled so that images of standard normal latents are mid-grey with a spread
    of about 0.3, and a parity test compares real variation."""
    last = [m for m in vae.decoder.modules() if isinstance(m, torch.nn.Conv2d)][-1]
    with torch.no_grad():
        last.bias.zero_()
        probe = (vae.decode(torch.randn(2, vae.config.latent_channels, 16, 16)).sample + 1) / 2
        last.weight.mul_(0.15 / probe.std())
        last.bias.fill_(0.5)


def _folder_of(given: str) -> Path:
    """A TINY_VAES name, a local folder, or a hub id -> the AutoencoderTiny's folder."""
    from export.source import local_or_hub

    return _random_folder(given) if given in TINY_VAES else local_or_hub(given, "--tiny-vae", TINY_VAES)


def tiny_vae_source(given: str, latent_channels: int):
    """The tiny autoencoder as a ModelSource of one component (`vae_tiny`), checked against the model's
    latent channels."""
    from export.source import ModelSource, SourceError, _folder_fingerprint, cache_root

    folder = _folder_of(given)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if config.get("_class_name") != "AutoencoderTiny":
        raise SourceError(f"--tiny-vae {given}: {folder} holds no AutoencoderTiny (its config.json names "
                          f"{config.get('_class_name')!r}); pass madebyollin's taesd, taesdxl, taesd3 or taef1")
    channels = config.get("latent_channels", 4)
    if channels != latent_channels:
        raise SourceError(f"--tiny-vae {given} has {channels} latent channels; this model's latents have "
                          f"{latent_channels}: pick the tiny autoencoder of its family (taesd/taesdxl 4, "
                          "taesd3/taef1 16)")
    fingerprint = _folder_fingerprint(folder)
    staged = cache_root() / "tiny-vae" / f"{folder.name}-{fingerprint}"  # the folder as a one-component pipeline

    def stage(tmp: Path) -> None:
        shutil.copytree(folder, tmp / COMPONENT, ignore=shutil.ignore_patterns(".*"))
        (tmp / "model_index.json").write_text(json.dumps({"_class_name": "AutoencoderTiny",
                                                          COMPONENT: ["diffusers", "AutoencoderTiny"]}))

    write_once(staged, "model_index.json", stage)
    entry = ModelEntry(name=str(given), family="tiny_vae", description=f"tiny autoencoder {given}")
    return ModelSource(entry, staged, fingerprint)


def runtime_constants(source, given: str) -> dict:
    """What the runner needs to scale latents for the tiny autoencoder (diffusers reads them from its config)."""
    config = source.config(COMPONENT)
    return {"scaling_factor": config.get("scaling_factor", 1.0), "shift_factor": config.get("shift_factor") or 0.0,
            "source": given}
