"""Flux's ControlNets in its runner, with the semantics of diffusers' FluxControlNetPipeline
(export/families/controlnet_flux.py describes the engines).

Each control image is resized to the request's size (which it does not set: Flux's default applies),
repeated for the images to generate, encoded by the VAE (a sample of its posterior: `control_noise`,
one per image; a list of them for several ControlNets), shifted, scaled and packed as the latents
are. The ControlNets run once per step on the prompt's conditions, and under true CFG the negative
prompt's half takes the same residuals, as diffusers passes them to both transformer calls. Double
block i adds residual i // ceil(N / k), single block j residual j // ceil(M / k') (diffusers' rule).
XLabs' ControlNets take the prepared image itself (no VAE), and double block i adds their residual i % k."""
from __future__ import annotations

import math

import numpy as np

from runners.conditioning.controlnet import ControlNets
from runners.families.flux.conditions import control_latents, control_pixels
from runners.text_to_image import IMAGE, INPAINT, TEXT


class FluxControlNets(ControlNets):
    # FluxControlNetPipeline's, and its Img2Img and Inpaint twins'
    control_scales = {TEXT: 1.0, IMAGE: 1.0, INPAINT: 1.0}
    control_sets_size = False
    guided_halves_share_residuals = True
    runs_with_step_caches = False

    def _control_input(self, name, given, request, height, width, n_images, per_prompt, cfg) -> np.ndarray:
        if self.manifest["constants"].get("controlnet_blocks_repeat"):  # XLabs' kind encodes the image itself
            return control_pixels(self, given, height, width, n_images)
        k = self.controlnets().index(name)
        noise = request.noise[k] if isinstance(request.noise, (list, tuple)) else request.noise
        return self.layout.pack(control_latents(self, given, height, width, n_images, noise, request.seed,
                                                request.vae_tiling, stream=2 + k))

    def _residual_feeds(self, name: str, out: dict, specs: list[dict]) -> list[np.ndarray]:
        """double_residual_i and single_residual_j from ControlNet `name`'s k and k' outputs by diffusers'
        interval rule, or (XLabs' kind: `controlnet_blocks_repeat`) double block i takes output i % k; zeros
        where it has no single-stream blocks."""
        c = self.manifest["constants"]
        counts = {kind: sum(o["name"].startswith(f"controlnet_{kind}_") for o in self.manifest["submodules"][name]
                            ["outputs"]) for kind in ("block", "single_block")}
        intervals = {"double": math.ceil(c["double_layers"] / max(counts["block"], 1)),
                     "single": math.ceil(c["single_layers"] / max(counts["single_block"], 1))}
        feeds = []
        for spec in specs:
            kind, _, index = spec["name"].rsplit("_", 2)
            taken = int(index) % counts["block"] if kind == "double" and c.get("controlnet_blocks_repeat") else \
                int(index) // intervals[kind]
            output = f"controlnet_{'block' if kind == 'double' else 'single_block'}_{taken}"
            feeds.append(out[output] if output in out else np.zeros_like(out["controlnet_block_0"]))
        return feeds

    def _residual_dims(self, x: np.ndarray, conditions: dict) -> dict:
        return {"batch": x.shape[0], "image_tokens": x.shape[1]}  # x: packed tokens
