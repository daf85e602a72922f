"""Qwen-Image's ControlNets in its runner, with the semantics of diffusers' QwenImageControlNetPipeline
(export/families/controlnet_qwen_image.py describes the engines): FLUX.1's (runners/families/flux/controlnet.py)
but for the rule that hands residuals to blocks.

Each control image is resized to the request's size (which it does not set), repeated for the images to
generate, encoded by the VAE (a sample of its posterior: `control_noise`, one per image, in diffusers' shape
(N, 16, 1, h, w) or without the frame axis; a list of them for several ControlNets), normalised and packed as
the latents are. The ControlNets run once per step on the prompt's conditions, and under true CFG the negative
prompt's half takes the same residuals, as diffusers passes them to both transformer calls. Block i adds
residual i // ceil(N / k) of a ControlNet of k blocks (diffusers' rule); several ControlNets add up.

Inpainting ControlNets (QwenImageControlNetInpaintPipeline's) repaint the control image where `mask_image` (diffusers'
`control_mask`) is white: the image with the masked part set to -1 is encoded, normalised, the kept part's mask at
latent size put beside its channels, and the whole packed (17 channels a latent pixel). The denoising starts from
noise, as diffusers' pipeline does (text to image: `image=` is refused)."""
from __future__ import annotations

import math

import numpy as np

from runners.families.flux.controlnet import FluxControlNets
from runners.text_to_image import TEXT


class QwenImageControlNets(FluxControlNets):
    control_scales = {TEXT: 1.0}  # QwenImageControlNetPipeline's (text to image only) and its Inpaint twin's
    masked_control_pipeline = "QwenImageControlNetInpaintPipeline"

    def _control_input(self, name, given, request, height, width, n_images, per_prompt, cfg) -> np.ndarray:
        if request.mask is None:
            return super()._control_input(name, given, request, height, width, n_images, per_prompt, cfg)
        return self.layout.pack(self._masked_control_latents(name, given, request, height, width, n_images,
                                                             per_prompt))

    def _residual_feeds(self, name: str, out: dict, specs: list[dict]) -> list[np.ndarray]:
        """block_residual_i takes output controlnet_block_{i // ceil(N / k)} of ControlNet `name` (k outputs)."""
        k = len(self.manifest["submodules"][name]["outputs"])
        interval = math.ceil(self.manifest["constants"]["transformer_layers"] / k)
        return [out[f"controlnet_block_{int(s['name'].rsplit('_', 1)[1]) // interval}"] for s in specs]
