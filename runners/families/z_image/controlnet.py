"""Z-Image's ControlNets in its runner, with the semantics of diffusers' ZImageControlNetPipeline and
ZImageControlNetInpaintPipeline (export/families/controlnet_z_image.py describes the engines).

Each control image is resized to the request's size (which it does not set: the default size applies),
repeated for the images to generate, and encoded by the VAE: its posterior's mode (diffusers'
sample_mode="argmax": nothing is drawn), shifted and scaled. A 2.x ControlNet (33 input channels) gets zeros
after those latents in text to image. With `image=` and `mask_image=` too it inpaints
(ZImageControlNetInpaintPipeline): the image with its masked part zeroed is encoded the same way, and the
ControlNet reads [control latents, the kept part's mask at latent size, the masked image's latents]. The
denoising still starts from noise, as diffusers' does (no strength, no blending). Under guidance both halves
read the same input; transformer layer p adds the residual of the ControlNet's place p."""
from __future__ import annotations

import numpy as np

from runners.conditioning.controlnet import ControlNets
from runners.conditioning.images import nearest, to_model_input
from runners.text_to_image import TEXT


class ZImageControlNets(ControlNets):
    control_scales = {TEXT: 0.75}  # both of diffusers' pipelines run text to image (the inpainting one masked)
    control_sets_size = False
    runs_with_step_caches = False

    def _control_inpainting(self, control_image, image, mask_image) -> tuple:
        if control_image is None or (image is None and mask_image is None):
            return image, mask_image, {}
        if image is None or mask_image is None:
            raise ValueError("control_image= with image= or mask_image= alone: Z-Image's ControlNets inpaint with both "
                             "(ZImageControlNetInpaintPipeline); for image to image there is no such pipeline")
        channels = self.manifest["constants"]["latent_channels"]
        flat = [n for n in self.controlnets() if self._control_channels(n) == channels]
        if flat:
            raise ValueError(f"{', '.join(flat)}: a 1.0 ControlNet ({channels} input "
                             "channels) cannot inpaint; ZImageControlNetInpaintPipeline takes a 2.x one (Z-Image-Turbo-"
                             "Fun-Controlnet-Union-2.0/2.1)")
        return None, None, {"mask": mask_image, "repainted": image}

    def _control_channels(self, name: str) -> int:
        inputs = self.manifest["submodules"][name]["inputs"]
        return next(i["shape"][1] for i in inputs if i["name"] == "controlnet_cond")

    def _control_input(self, name, given, request, height, width, n_images, per_prompt, cfg) -> np.ndarray:
        scale = self.constants["vae_scale_factor"]

        def latents_of(pixels):  # the posterior's mode: its mean (the tiny encoder's latents as they are)
            return self._posterior_latents(self.vae_encode(pixels, tiling=request.vae_tiling)[:1], None)

        def batch(value, mask=False):
            return self._control_batch(name, to_model_input(value, height, width, scale, mask=mask), n_images,
                                       per_prompt, False)

        latents = latents_of(batch(given))
        n, _, h, w = latents.shape
        if request.mask is not None:
            mask = batch(request.mask, mask=True)
            masked = latents_of(batch(request.repainted) * (mask < 0.5))
            latents = np.concatenate([latents, nearest(1 - mask, h, w), masked], axis=1)
        else:
            zeros = np.zeros((n, self._control_channels(name) - latents.shape[1], h, w), dtype=np.float32)
            latents = np.concatenate([latents, zeros], axis=1)
        return np.concatenate([latents, latents]) if cfg else latents

    def _residual_feeds(self, name: str, out: dict, specs: list[dict]) -> list[np.ndarray]:
        """block_residual_p takes output controlnet_block_p, zeros where the ControlNet has no place p."""
        taken = [out.get(f"controlnet_block_{s['name'].rsplit('_', 1)[1]}") for s in specs]
        return [np.zeros_like(next(iter(out.values()))) if r is None else r for r in taken]

    def _residual_dims(self, x: np.ndarray, conditions: dict) -> dict:
        return {"batch": x.shape[0], "hidden_tokens": self.hidden_tokens(x.shape[2:], conditions)}
