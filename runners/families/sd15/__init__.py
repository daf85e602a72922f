"""Stable Diffusion 1.x text-to-image, with the semantics of diffusers' StableDiffusionPipeline:
CLIP-L's last hidden state conditions the UNet through cross-attention; the scheduler is the
one the artifact's config names (PNDM for SD1.5), guidance batched, the VAE without a shift.

Not ported: the safety checker (an artifact carries no image classifier; diffusers blacks out
the images it flags, the runner returns them as generated) and `guidance_rescale`."""
from __future__ import annotations

import numpy as np

from runners.conditioning.controlnet import CONTROL_OPTIONS, GUESS_MODE, ControlNets
from runners.options import IMAGE_TASKS, REQUEST, options
from runners.latents import LatentLayout
from runners.text_to_image import IMAGE, INPAINT, TEXT, Defaults, TextToImage


class SD15Pipeline(ControlNets, TextToImage):
    family = "sd15"
    # ComfyUI's latent_rgb_factors and bias for SD1.5's latents (runners/preview.py)
    layout = LatentLayout(latent_rgb={4: (
        [[0.3512, 0.2297, 0.3227], [0.3250, 0.4974, 0.2350], [-0.2829, 0.1762, 0.2721],
         [-0.2120, -0.2616, -0.7177]],
        [0.0, 0.0, 0.0])})
    # diffusers' defaults: its text-to-image, Img2Img and Inpaint pipelines'
    defaults = {TEXT: Defaults(50, 7.5), IMAGE: Defaults(50, 7.5, 0.8), INPAINT: Defaults(50, 7.5, 1.0)}
    options = options(REQUEST, TextToImage.guidance.options, IMAGE_TASKS, CONTROL_OPTIONS, (GUESS_MODE,))

    def generate(self, prompt, negative_prompt=None, height=None, width=None, num_inference_steps=None,
                 guidance_scale=None, num_images_per_prompt=1, seed=None, latents=None, output_type="pil",
                 vae_tiling=None, image=None, mask_image=None, strength=None, noise=None, encoder_noise=None,
                 control_image=None, controlnet_conditioning_scale=None, control_guidance_start=0.0,
                 control_guidance_end=1.0, guess_mode=False):
        """Generate images (call the pipeline: `pipe(prompt, ...)`, which adds `profile=DIR`); from an
        `image` too (image to image, with `strength`), and a `mask_image` (inpainting). Steps, guidance
        and strength left None take `defaults`, those of diffusers' pipeline for the task.
        `seed` seeds numpy's generator; pass `latents` (standard normal, before the scheduler's
        initial noise scale) for exact comparison with diffusers. `vae_tiling`: see `vae_decode`.
        `control_image` (one per ControlNet of the artifact) and the other ControlNet settings are those of
        diffusers' StableDiffusionControlNet pipelines (runners/conditioning/controlnet.py):
        `controlnet_conditioning_scale` defaults to 1, 0.8 for image to image and 0.5 for inpainting."""
        return self._controlled_text_to_image(
            prompt, negative_prompt, height, width, num_inference_steps, guidance_scale, num_images_per_prompt, seed,
            latents, output_type, vae_tiling, image=image, mask_image=mask_image, strength=strength, noise=noise,
            encoder_noise=encoder_noise, control_image=control_image,
            controlnet_conditioning_scale=controlnet_conditioning_scale, control_guidance_start=control_guidance_start,
            control_guidance_end=control_guidance_end, guess_mode=guess_mode)

    def _conditions(self, prompts, negative_prompt, per_prompt, cfg, height, width, control=None):
        embeds = self._encode(prompts, per_prompt)
        if cfg:
            embeds = self.guidance.batch(embeds, self._encode(self._negatives(prompts, negative_prompt), per_prompt))
        return {"encoder_hidden_states": embeds,
                **self._control_conditions(control, height, width, len(prompts) * per_prompt, per_prompt, cfg)}

    def _encode(self, prompts: list[str], per_prompt: int) -> np.ndarray:
        ids = self.tokenizers["tokenizer"](prompts, self.constants["clip_length"])
        return np.repeat(self.run("text_encoder", input_ids=ids)["last_hidden_state"], per_prompt, axis=0)
