"""Qwen-Image's ControlNets in its runner, with the semantics of diffusers' QwenImageControlNetPipeline
(export/families/controlnet_qwen_image.py describes the engines): FLUX.1's (runners/families/flux/controlnet.py)
but for the rule that hands residuals to blocks.

Each control image is resized to the request's size (which it does not set), repeated for the images to
generate, encoded by the VAE (a sample of its posterior: `control_noise`, one per image, in diffusers' shape
(N, 16, 1, h, w) or without the frame axis; a list of them for several ControlNets), normalised and packed as
the latents are. The ControlNets run once per step on the prompt's conditions, and under true CFG the negative
prompt's half takes the same residuals, as diffusers passes them to both transformer calls. Block i adds
residual i // ceil(N / k) of a ControlNet of k blocks (diffusers' rule); several ControlNets add up."""
from __future__ import annotations

import math

import numpy as np

from runners.families.flux.controlnet import FluxControlNets
from runners.text_to_image import TEXT


class QwenImageControlNets(FluxControlNets):
    control_scales = {TEXT: 1.0}  # QwenImageControlNetPipeline's (text to image only)

    def _residual_feeds(self, name: str, out: dict, specs: list[dict]) -> list[np.ndarray]:
        """block_residual_i takes output controlnet_block_{i // ceil(N / k)} of ControlNet `name` (k outputs)."""
        k = len(self.manifest["submodules"][name]["outputs"])
        interval = math.ceil(self.manifest["constants"]["transformer_layers"] / k)
        return [out[f"controlnet_block_{int(s['name'].rsplit('_', 1)[1]) // interval}"] for s in specs]
