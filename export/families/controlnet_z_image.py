"""Z-Image's ControlNets (diffusers' ZImageControlNetModel: Z-Image-Turbo's Fun ControlNet-Union 1.0 and 2.x in
diffusers' format), as ZImageControlNetPipeline and ZImageControlNetInpaintPipeline run them.

A Z-Image ControlNet is a few control blocks beside the transformer's. It embeds the control input, runs the
transformer's own embedders and refiners, which its pipeline lends it (`from_transformer`), and returns one
residual per layer of `control_layers_places`, which the transformer adds to its stream after that layer.
Its folder holds only its own weights: the export stages it with the lent modules' weights (a file of their
own) and names a loader (`WithLentModules`) that builds it as the pipeline holds it. The transformer takes one
residual input per place (`block_residual_<layer>`, export/families/z_image.py) only when exported with
ControlNets; the engine's outputs are named by place too (`controlnet_block_<layer>`), times
`conditioning_scale` (one factor each).

The versions, as diffusers' loader tells them apart:
- 1.0 (`control_in_dim` 16, `add_control_noise_refiner` None): the control image's latents, through a noise
  refiner of its own;
- 2.x (`control_in_dim` 33: the control latents, the inpainting mask and the masked image's latents, the last
  two zeros in the text-to-image pipeline): its control blocks (2.0, "control_layers") or its control noise
  refiner (2.1, "control_noise_refiner") add hints to the image stream inside the transformer's noise refiner.
The engine reads what the transformer reads (latents, timestep, captions and their lengths) and the control
input at latent size; the runner encodes the images (runners/families/z_image/controlnet.py)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from export.families.parts import residual_controlnet
from export.families.z_image import HIDDEN, PATCH, TRANSFORMER, PaddedStreams, controlled_transformer, patches
from export.random_weights import redraw
from export.spec import ControlNetKind, SubmoduleSpec

# What ZImageControlNetModel.from_transformer lends it: the transformer's modules, by their weights' prefixes
LENT = ("t_embedder.", "all_x_embedder.", "cap_embedder.", "noise_refiner.", "context_refiner.", "x_pad_token",
        "cap_pad_token")
LENT_WEIGHTS = "transformer_lent.safetensors"
TRANSFORMER_CONFIG = "transformer_config.json"


class WithLentModules:
    """The loader a staged Z-Image ControlNet folder names in its model_index.json (its config as
    `load_config` / `from_config` / `from_pretrained` read it): ZImageControlNetModel.from_transformer of a
    transformer built from the transformer's config without its main layers (which the ControlNet never runs),
    the lent modules' weights read from the folder with the ControlNet's own."""

    @staticmethod
    def load_config(folder) -> dict:
        return {name: json.loads((Path(folder) / file).read_text())
                for name, file in (("controlnet", "config.json"), ("transformer", TRANSFORMER_CONFIG))}

    @staticmethod
    def from_config(config: dict):
        from diffusers import ZImageControlNetModel, ZImageTransformer2DModel

        controlnet = ZImageControlNetModel.from_config(config["controlnet"])
        transformer = ZImageTransformer2DModel.from_config({**config["transformer"], "n_layers": 0})
        return ZImageControlNetModel.from_transformer(controlnet, transformer)

    @classmethod
    def from_pretrained(cls, folder):
        from safetensors.torch import load_file

        model = cls.from_config(cls.load_config(folder))
        state = {k: v for file in sorted(Path(folder).glob("*.safetensors")) for k, v in load_file(file).items()}
        model.load_state_dict(state, strict=True)
        return model


class _ZImageControlNet(PaddedStreams):
    """diffusers' ZImageControlNetModel.forward on the transformer's padded inputs (export/families/z_image.py),
    then the control input and the scales: its residuals, in its places' order."""

    def __init__(self, controlnet):
        super().__init__("controlnet", controlnet)

    def forward(self, latent, timestep, caption, caption_lengths, controlnet_cond, conditioning_scale):
        m, s = self.controlnet, self.streams(latent, timestep, caption, caption_lengths)
        control = m.control_all_x_embedder[f"{PATCH}-1"](patches(controlnet_cond))
        pad = m.x_pad_token.expand(control.shape[0], s.image_slots - s.n_image, -1).to(control.dtype)
        control, x, hints = torch.cat([control, pad], dim=1), s.x, {}
        if m.add_control_noise_refiner is not None:  # 2.x: hints for the noise refiner's layers
            refiner = m.control_layers if m.add_control_noise_refiner == "control_layers" else m.control_noise_refiner
            for layer in refiner:
                control = layer(control, x, None, s.x_freqs, s.adaln)
            *skips, control = torch.unbind(control)
            # scaled as the residuals are (the factors are the ControlNet's one scale: Z-Image has no guess mode)
            hints = {p: skip * conditioning_scale[0] for p, skip in zip(m.control_refiner_layers_places, skips)}
        for i, layer in enumerate(m.noise_refiner):
            x = layer(x, None, s.x_freqs, s.adaln)
            if i in hints:
                x = x + hints[i]
        if m.add_control_noise_refiner is None:  # 1.0: its own noise refiner on the control tokens
            for layer in m.control_noise_refiner:
                control = layer(control, None, s.x_freqs, s.adaln)
        cap = self.refined_caption(s)
        joint, joint_control = torch.cat([x, cap], dim=1), torch.cat([control, cap], dim=1)
        freqs, mask = torch.cat([s.x_freqs, s.cap_freqs], dim=1), self.joint_mask(s)
        for layer in m.control_layers:
            joint_control = layer(joint_control, joint, mask, freqs, s.adaln)
        *skips, _ = torch.unbind(joint_control)
        return tuple(skip * conditioning_scale[j] for j, skip in enumerate(skips))


def _spec(config: dict) -> SubmoduleSpec:
    return residual_controlnet(TRANSFORMER, ("batch", config["control_in_dim"], "latent_height", "latent_width"),
                               config["control_layers_places"], HIDDEN, _ZImageControlNet, PATCH)


def _check(config: dict, base, given: str) -> None:
    from export.source import SourceError

    transformer = base.config("transformer")
    for key in ("dim", "n_heads"):
        if config.get(key) != transformer[key]:
            raise SourceError(f"controlnet {given} has {key}={config.get(key)}; {base.entry.name}'s transformer has "
                              f"{transformer[key]}: pass a ControlNet trained for this base model")
    for key, count in (("control_layers_places", transformer["n_layers"]),
                       ("control_refiner_layers_places", transformer["n_refiner_layers"])):
        outside = [p for p in config.get(key) or () if not 0 <= p < count]
        if outside:
            raise SourceError(f"controlnet {given}: {key} {outside} are not layers of {base.entry.name}'s transformer "
                              f"(it has {count}): pass a ControlNet trained for this base model")
    channels = transformer["in_channels"]
    patch_sizes = config.get("all_patch_size", [PATCH])  # ZImageControlNetModel's default: (2,)
    if config["control_in_dim"] not in (channels, 2 * channels + 1) or PATCH not in patch_sizes:
        raise SourceError(f"controlnet {given}: control_in_dim={config['control_in_dim']} and all_patch_size="
                          f"{patch_sizes}; Z-Image's pipelines give {channels} or {2 * channels + 1} channels in "
                          f"patches of {PATCH}")


def _complete(config: dict, folder: Path, base, out: Path) -> None:
    """The ControlNet with the transformer's lent modules: its files linked, the lent weights copied into a file
    of their own (they are a few blocks), the transformer's config beside its own."""
    from export.lazy_weights import copy_tensors, link_checkpoint

    link_checkpoint(folder, out)
    copy_tensors(base.folder / "transformer", LENT, out / LENT_WEIGHTS)
    (out / "config.json").write_text(json.dumps(config))
    (out / TRANSFORMER_CONFIG).write_text(json.dumps(base.config("transformer")))


def _build_random(base, seed: int, out, inpainting: bool = False) -> None:
    """A ZImageControlNetModel for the base's transformer with a control block at every fifth of its layers from
    the first, as 1.0's places (0, 5, ... 25 of 30; z-image-tiny's second layer then runs without a residual), and
    seeded random weights in its zero-initialised projections (zero ones would change nothing, and a test could
    not tell): 1.0's layout, or with `inpainting` 2.1's (33 channels, a control noise refiner)."""
    from diffusers import ZImageControlNetModel

    tr = base.config("transformer")
    torch.manual_seed(seed)
    controlnet = ZImageControlNetModel(
        control_layers_places=list(range(0, tr["n_layers"], 5)),
        control_refiner_layers_places=list(range(tr["n_refiner_layers"])) if inpainting else None,
        control_in_dim=2 * tr["in_channels"] + 1 if inpainting else tr["in_channels"],
        add_control_noise_refiner="control_noise_refiner" if inpainting else None,
        **{k: tr[k] for k in ("all_patch_size", "all_f_patch_size", "dim", "n_refiner_layers", "n_heads", "n_kv_heads",
                              "norm_eps", "qk_norm")})
    blocks = [*controlnet.control_layers, *(controlnet.control_noise_refiner if inpainting else ())]
    redraw([proj for b in blocks for proj in (getattr(b, "before_proj", None), b.after_proj) if proj is not None], seed)
    controlnet.save_pretrained(out, safe_serialization=True)


KINDS = {"z_image": ControlNetKind(class_name="ZImageControlNetModel", check=_check, spec=_spec,
                                   constants=lambda configs, base: {}, build_random=_build_random,
                                   controlled=controlled_transformer, borrows=lambda config: "transformer",
                                   complete=_complete, loader=(__name__, WithLentModules.__name__))}
