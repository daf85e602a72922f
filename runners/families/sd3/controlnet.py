"""SD3's ControlNets in its runner, with the semantics of diffusers' StableDiffusion3ControlNetPipeline
and StableDiffusion3ControlNetInpaintingPipeline (export/families/controlnet_sd3.py describes the engines).

Each control image is resized to the request's size (which it does not set: SD3's default applies),
repeated for the images to generate, then encoded by the VAE: a sample of its posterior (`control_noise`),
shifted (unless the ControlNet forces zero pooled projections, as InstantX's do and diffusers reads from
its config) and scaled. The ControlNet pipeline doubles the image under guidance before it encodes it
(two samples: `control_noise` is 2N there). The transformer block i adds the residual int(i / (N / k)) of
each ControlNet of k blocks (diffusers' interval rule; N blocks).

Inpainting ControlNets (alimama's) repaint the control image where `mask_image` is white: the image with
the masked part set to -1 is encoded (N samples) and shifted, the inverted mask at latent size is
concatenated to its latents, and the whole is doubled under guidance. The denoising starts from noise, as
diffusers' pipeline does (text to image: `image=` is refused)."""
from __future__ import annotations

import numpy as np

from runners.conditioning.controlnet import ControlNets
from runners.conditioning.images import to_model_input
from runners.text_to_image import TEXT


class SD3ControlNets(ControlNets):
    control_scales = {TEXT: 1.0}  # diffusers' has no Img2Img twin; its Inpainting one is text to image, masked
    control_sets_size = False
    runs_with_step_caches = False
    masked_control_pipeline = "StableDiffusion3ControlNetInpaintingPipeline"

    def _control_input(self, name, given, request, height, width, n_images, per_prompt, cfg) -> np.ndarray:
        if request.mask is not None:
            latents = self._masked_control_latents(name, given, request, height, width, n_images, per_prompt)
            return np.concatenate([latents, latents]) if cfg else latents
        pixels = to_model_input(given, height, width, self.constants["vae_scale_factor"])
        posterior = self.vae_encode(self._control_batch(name, pixels, n_images, per_prompt, False),
                                    tiling=request.vae_tiling)
        if cfg:  # diffusers encodes the doubled batch: the same posteriors, each half its own sample
            posterior = [np.concatenate([p, p]) for p in posterior]
        noise = self._control_noise(name, request, posterior[0].shape)
        return self._posterior_latents(posterior, noise, shift=not self._zero_pooled(name))

    def _zero_pooled(self, name: str) -> bool:
        """Whether ControlNet `name` takes zero pooled projections (its graph then takes none)."""
        return all(i["name"] != "pooled_projections" for i in self.manifest["submodules"][name]["inputs"])

    def _residual_feeds(self, name: str, out: dict, specs: list[dict]) -> list[np.ndarray]:
        """Block i's residual input (block_residual_i) takes output int(i / (N / k)) of the ControlNet's k."""
        k = len(self.manifest["submodules"][name]["outputs"])
        interval = self.manifest["constants"]["transformer_layers"] / k
        return [out[f"controlnet_block_{int(int(s['name'].rsplit('_', 1)[1]) / interval)}"] for s in specs]

    def _residual_dims(self, x: np.ndarray, conditions: dict) -> dict:
        return {"batch": x.shape[0], "image_tokens": self.hidden_tokens(x.shape[2:], {})}
