"""SD3's ControlNets in its runner, with the semantics of diffusers' StableDiffusion3ControlNetPipeline
(export/families/controlnet_sd3.py describes the engines).

Each control image is resized to the request's size (which it does not set: SD3's default applies),
repeated for the images to generate, doubled under guidance, then encoded by the VAE: a sample of its
posterior (`control_noise`, one per image the ControlNet runs on: the doubled batch under guidance,
as diffusers encodes both halves), shifted (unless the ControlNet forces zero pooled projections, as
InstantX's do and diffusers reads from its config) and scaled. The transformer block i adds the
residual int(i / (N / k)) of each ControlNet of k blocks (diffusers' interval rule; N blocks)."""
from __future__ import annotations

import numpy as np

from runners.controlnet import ControlNets
from runners.images import to_model_input
from runners.text_to_image import TEXT, given_or_drawn


class SD3ControlNets(ControlNets):
    control_scales = {TEXT: 1.0}  # diffusers' has no Img2Img twin (its Inpainting one takes masks as channels)
    control_sets_size = False
    runs_with_step_caches = False

    def _control_input(self, name, given, request, height, width, n_images, per_prompt, cfg) -> np.ndarray:
        scale = self.constants["vae_scale_factor"]
        pixels = self._control_batch(name, to_model_input(given, height, width, scale), n_images, per_prompt, False)
        posterior = self.vae_encode(pixels, tiling=request.vae_tiling)
        if cfg:  # diffusers encodes the doubled batch: the same posteriors, each half its own sample
            posterior = [np.concatenate([p, p]) for p in posterior]
        if len(posterior) == 1:  # the tiny autoencoder's latents, as they are
            z = posterior[0]
        else:
            mean, logvar = posterior
            k = self.controlnets().index(name)
            noise = request.noise[k] if isinstance(request.noise, (list, tuple)) else request.noise
            rng = np.random.default_rng(None if request.seed is None else (request.seed, 2 + k))
            z = mean + np.exp(np.float32(0.5) * logvar) * given_or_drawn("control_noise", noise, mean.shape, rng)
        scaling, shift = self.vae_factors()
        return (z - np.float32(0 if self._zero_pooled(name) else shift)) * np.float32(scaling)

    def _zero_pooled(self, name: str) -> bool:
        """Whether ControlNet `name` forces zero pooled projections (its graph then takes none)."""
        return all(i["name"] != "pooled_projections" for i in self.manifest["submodules"][name]["inputs"])

    def _residual_feeds(self, name: str, out: dict, specs: list[dict]) -> list[np.ndarray]:
        """Block i's residual input (block_residual_i) takes output int(i / (N / k)) of the ControlNet's k."""
        k = len(self.manifest["submodules"][name]["outputs"])
        interval = self.manifest["constants"]["transformer_layers"] / k
        return [out[f"controlnet_block_{int(int(s['name'].rsplit('_', 1)[1]) / interval)}"] for s in specs]

    def _residual_dims(self, x: np.ndarray) -> dict:
        return {"batch": x.shape[0], "image_tokens": self.hidden_tokens(*x.shape[2:])}
