"""Stable Diffusion 1.x text-to-image, with the semantics of diffusers' StableDiffusionPipeline:
CLIP-L's last hidden state conditions the UNet through cross-attention; the scheduler is the
one the artifact's config names (PNDM for SD1.5), guidance batched, the VAE without a shift.

Not ported: the safety checker (an artifact carries no image classifier; diffusers blacks out
the images it flags, the runner returns them as generated) and `guidance_rescale`."""
from __future__ import annotations

import numpy as np

from runners.text_to_image import TextToImage


class SD15Pipeline(TextToImage):
    family = "sd15"
    default_strength = 0.8  # diffusers' image-to-image default for this family

    def generate(self, prompt, negative_prompt=None, height=None, width=None, num_inference_steps=50,
                 guidance_scale=7.5, num_images_per_prompt=1, seed=None, latents=None, output_type="pil",
                 vae_tiling=None, image=None, strength=None, noise=None, encoder_noise=None):
        """Generate images (call the pipeline: `pipe(prompt, ...)`, which adds `profile=DIR`).
        `seed` seeds numpy's generator; pass `latents` (standard normal, before the scheduler's
        initial noise scale) for exact comparison with diffusers. `vae_tiling`: see `vae_decode`."""
        return self._text_to_image(prompt, negative_prompt, height, width, num_inference_steps, guidance_scale,
                                   num_images_per_prompt, seed, latents, output_type, vae_tiling,
                                   image=image, strength=strength, noise=noise, encoder_noise=encoder_noise)

    def _conditions(self, prompts, negative_prompt, per_prompt, cfg, height, width):
        embeds = self._encode(prompts, per_prompt)
        if cfg:
            embeds = np.concatenate([self._encode(self._negatives(prompts, negative_prompt), per_prompt), embeds])
        return {"encoder_hidden_states": embeds}

    def _encode(self, prompts: list[str], per_prompt: int) -> np.ndarray:
        ids = self.tokenizers["tokenizer"](prompts, self.constants["clip_length"])
        return np.repeat(self.run("text_encoder", input_ids=ids)["last_hidden_state"], per_prompt, axis=0)
