"""Qwen-Image's ControlNets (diffusers' QwenImageControlNetModel: InstantX's ControlNet-Union and the like), as
QwenImageControlNetPipeline runs them.

A Qwen-Image ControlNet is a shorter Qwen-Image transformer: its k blocks each give a residual for the image
stream, and diffusers' transformer adds residual i // ceil(N / k) after its block i (N blocks). As for Flux
(controlnet_flux.py), the transformer takes one residual input per block (`block_residual_i`) only when exported
with ControlNets, and the runner hands each ControlNet's residuals to the blocks by that rule. The engine reads
what the transformer reads (packed latents, the text and its mask, the timestep, the rotary positions as ids)
and the control image's packed VAE latents (the runner encodes them), and returns its k residuals times
`conditioning_scale` (one factor each). An inpainting ControlNet (`extra_condition_channels`, InstantX's
Qwen-Image-ControlNet-Inpainting: QwenImageControlNetInpaintPipeline) reads the masked image's packed latents with
the kept area's mask beside them (17 channels a latent pixel: 68 packed); the runner makes them."""
from __future__ import annotations

import torch

from export.families.parts import residual_controlnet
from export.families.qwen_image import HIDDEN, TRANSFORMER, GivenPositions, controlled_transformer
from export.random_weights import redraw
from export.spec import ControlNetKind, SubmoduleSpec

# The transformer's settings a ControlNet must share with it, to read its inputs and add to its stream
_SHARED = ("in_channels", "joint_attention_dim", "axes_dims_rope", "num_attention_heads", "attention_head_dim")
MASK_CHANNELS = 4  # an inpainting ControlNet's mask channel, packed in 2 x 2 patches


class _QwenImageControlNet(GivenPositions):
    def __init__(self, controlnet):
        super().__init__("controlnet", controlnet)

    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, img_ids, txt_ids,
                controlnet_cond, conditioning_scale):
        samples = self.controlnet(hidden_states=hidden_states, controlnet_cond=controlnet_cond,
                                  encoder_hidden_states=encoder_hidden_states,
                                  encoder_hidden_states_mask=encoder_hidden_states_mask, timestep=timestep,
                                  img_shapes=self.tables(img_ids, txt_ids), return_dict=False)
        return tuple(s * conditioning_scale[i] for i, s in enumerate(samples))


def _masks(config: dict) -> bool:
    """Whether the ControlNet inpaints: reads a mask beside the masked image's latents."""
    return bool(config.get("extra_condition_channels", 0))


def _spec(config: dict) -> SubmoduleSpec:
    # its embedders kept in float, as the transformer's
    keep = (*TRANSFORMER.quantization["keep_scopes"], "controlnet_x_embedder")
    channels = config["in_channels"] + config["extra_condition_channels"] if _masks(config) else "packed_channels"
    return residual_controlnet(TRANSFORMER, ("batch", "image_tokens", channels), range(config["num_layers"]),
                               HIDDEN, _QwenImageControlNet, "latent_multiple",  # a packed token's side
                               {**TRANSFORMER.quantization, "keep_scopes": keep})


def _check(config: dict, base, given: str) -> None:
    from export.source import SourceError

    transformer = base.config("transformer")
    for key in _SHARED:
        if config.get(key) != transformer.get(key):
            raise SourceError(f"controlnet {given} has {key}={config.get(key)}; {base.entry.name}'s transformer has "
                              f"{transformer.get(key)}: pass a ControlNet trained for this base model")
    if config.get("extra_condition_channels", 0) not in (0, MASK_CHANNELS):
        raise SourceError(f"controlnet {given} has extra_condition_channels={config['extra_condition_channels']}; "
                          f"QwenImageControlNetInpaintPipeline gives {MASK_CHANNELS} (the mask, packed) or none")


def _constants(configs: list[dict], base) -> dict:
    from export.source import SourceError

    if len({_masks(c) for c in configs}) > 1:
        raise SourceError("inpainting ControlNets (extra_condition_channels) and others run in different diffusers "
                          "pipelines: export them apart")
    return {"transformer_layers": base.config("transformer")["num_layers"], "control_masks": int(_masks(configs[0]))}


def _build_random(base, seed: int, out, inpainting: bool = False) -> None:
    """QwenImageControlNetModel.from_transformer of the base's transformer, one block deep (with `inpainting`,
    reading the mask too), with seeded random weights in its zero-initialised control embedding and output
    projections (zero ones would change nothing, and a test could not tell)."""
    from diffusers import QwenImageControlNetModel, QwenImageTransformer2DModel

    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel.from_pretrained(base.folder / "transformer")
    config = transformer.config
    controlnet = QwenImageControlNetModel.from_transformer(transformer, num_layers=1,
                                                           attention_head_dim=config.attention_head_dim,
                                                           num_attention_heads=config.num_attention_heads,
                                                           extra_condition_channels=MASK_CHANNELS if inpainting else 0)
    redraw([*controlnet.controlnet_blocks, controlnet.controlnet_x_embedder], seed)
    controlnet.save_pretrained(out, safe_serialization=True)


KINDS = {"qwen_image": ControlNetKind(
    class_name="QwenImageControlNetModel", check=_check, spec=_spec, build_random=_build_random, constants=_constants,
    controlled=controlled_transformer)}
