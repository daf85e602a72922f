"""Stable Diffusion XL text-to-image, with the semantics of diffusers' StableDiffusionXLPipeline:
the penultimate states of CLIP-L and CLIP-G side by side, CLIP-G's pooled projection and the
six size conditions ("time ids", or five with an aesthetic score) as the UNet's added conditions,
Euler by default.

Without a negative prompt, the unconditional half is zeros (the pipeline's
force_zeros_for_empty_prompt). Not ported: a second prompt for CLIP-G (`prompt_2`; both encoders
read `prompt`), negative size conditions, and the invisible watermark diffusers adds when the
`invisible-watermark` package is installed."""
from __future__ import annotations

import numpy as np

from runners.conditioning.controlnet import CONTROL_OPTIONS, GUESS_MODE, ControlNets
from runners.options import IMAGE_TASKS, REQUEST, Option, options
from runners.latents import LatentLayout
from runners.text_to_image import IMAGE, INPAINT, TEXT, Defaults, TextToImage


class SDXLPipeline(ControlNets, TextToImage):
    family = "sdxl"
    # ComfyUI's latent_rgb_factors and bias for SDXL's latents (runners/preview.py)
    layout = LatentLayout(latent_rgb={4: (
        [[0.3651, 0.4232, 0.4341], [-0.2533, -0.0042, 0.1068], [0.1076, 0.1111, -0.0362],
         [-0.3165, -0.2492, -0.2188]],
        [0.1084, -0.0175, -0.0011])})
    # diffusers' defaults: its text-to-image, Img2Img and Inpaint pipelines'
    defaults = {TEXT: Defaults(50, 5.0), IMAGE: Defaults(50, 5.0, 0.3), INPAINT: Defaults(50, 7.5, 0.9999)}
    control_defaults = {IMAGE: Defaults(50, 5.0, 0.8), INPAINT: Defaults(50, 5.0, 0.9999)}
    control_scales = {TEXT: 1.0, IMAGE: 0.8, INPAINT: 1.0}
    options = options(REQUEST, TextToImage.guidance.options, IMAGE_TASKS, (
        Option("original_size", "pairs", "SDXL's micro-condition (height, width); default: the image's size",
               cli=False),
        Option("crops_coords_top_left", "pairs", "SDXL's micro-condition (top, left)", default=(0, 0), cli=False),
        Option("target_size", "pairs", "SDXL's micro-condition (height, width); default: the image's size", cli=False),
        Option("aesthetic_score", "float", "a refiner-like UNet's aesthetic score condition", default=6.0),
        Option("negative_aesthetic_score", "float", "... and its unconditional half's", default=2.5),
    ), CONTROL_OPTIONS, (GUESS_MODE,))

    def generate(self, prompt, negative_prompt=None, height=None, width=None, num_inference_steps=None,
                 guidance_scale=None, num_images_per_prompt=1, seed=None, latents=None, output_type="pil",
                 original_size=None, crops_coords_top_left=(0, 0), target_size=None, vae_tiling=None, image=None,
                 mask_image=None, strength=None, noise=None, encoder_noise=None, aesthetic_score=6.0,
                 negative_aesthetic_score=2.5, control_image=None, controlnet_conditioning_scale=None,
                 control_guidance_start=0.0, control_guidance_end=1.0, guess_mode=False):
        """Generate images (call the pipeline: `pipe(prompt, ...)`, which adds `profile=DIR`); from an
        `image` too (image to image, with `strength`), and a `mask_image` (inpainting). Steps, guidance
        and strength left None take `defaults`, those of diffusers' pipeline for the task.
        `original_size`, `crops_coords_top_left` and `target_size` ((height, width) pairs; the
        first and last default to the image's size) are SDXL's micro-conditions; a UNet trained with
        aesthetic scores (the refiner's structure) takes `aesthetic_score` and `negative_aesthetic_score`
        in place of the target size. `seed` seeds numpy's generator; pass `latents` for exact
        comparison with diffusers. `control_image` (one per ControlNet of the artifact) and the other
        ControlNet settings are those of diffusers' StableDiffusionXLControlNet pipelines (runners/conditioning/controlnet.py),
        whose defaults differ for image to image (strength 0.8) and inpainting (guidance 5).
        `controlnet_conditioning_scale` defaults to 1, and 0.8 for image to image."""
        return self._controlled_text_to_image(
            prompt, negative_prompt, height, width, num_inference_steps, guidance_scale, num_images_per_prompt, seed,
            latents, output_type, vae_tiling, image=image, mask_image=mask_image, strength=strength, noise=noise,
            encoder_noise=encoder_noise, original_size=original_size, crops=crops_coords_top_left,
            target_size=target_size, aesthetic_score=aesthetic_score, negative_aesthetic_score=negative_aesthetic_score,
            control_image=control_image, controlnet_conditioning_scale=controlnet_conditioning_scale,
            control_guidance_start=control_guidance_start, control_guidance_end=control_guidance_end,
            guess_mode=guess_mode)

    def _conditions(self, prompts, negative_prompt, per_prompt, cfg, height, width, original_size, crops,
                    target_size, aesthetic_score, negative_aesthetic_score, control=None):
        embeds, pooled = self._encode(prompts, per_prompt)
        if cfg:
            if negative_prompt is None and self.constants["force_zeros_for_empty_prompt"]:
                neg_embeds, neg_pooled = np.zeros_like(embeds), np.zeros_like(pooled)
            else:
                neg_embeds, neg_pooled = self._encode(self._negatives(prompts, negative_prompt), per_prompt)
            embeds, pooled = self.guidance.batch(embeds, neg_embeds), self.guidance.batch(pooled, neg_pooled)
        original_size = original_size or (height, width)
        sizes = [*original_size, *crops, *(target_size or (height, width))]
        if len(sizes) != 6:
            raise ValueError(f"original_size, crops_coords_top_left and target_size are (height, width) pairs; "
                             f"got {original_size}, {crops}, {target_size}")
        if self.manifest["constants"]["time_ids"] == 5:
            # A UNet trained with an aesthetic score in place of the target size (diffusers'
            # requires_aesthetics_score): the unconditional half gets the negative score.
            sizes, negative_sizes = ([*original_size, *crops, score] for score in (aesthetic_score,
                                                                                  negative_aesthetic_score))
        else:
            negative_sizes = sizes
        n = len(embeds) // 2 if cfg else len(embeds)
        rows = np.array([sizes] * n, dtype=np.float32)
        if cfg:
            rows = self.guidance.batch(rows, np.array([negative_sizes] * n, dtype=np.float32))
        return {"encoder_hidden_states": embeds, "text_embeds": pooled, "time_ids": rows,
                **self._control_conditions(control, height, width, n, per_prompt, cfg)}

    def _encode(self, prompts: list[str], per_prompt: int):
        """Penultimate states of both CLIPs side by side; pooled: CLIP-G's projection."""
        length = self.constants["clip_length"]
        first = self.run("text_encoder", input_ids=self.tokenizers["tokenizer"](prompts, length))
        second = self.run("text_encoder_2", input_ids=self.tokenizers["tokenizer_2"](prompts, length))
        embeds = np.concatenate([first["penultimate_hidden_states"], second["penultimate_hidden_states"]], axis=-1)
        return np.repeat(embeds, per_prompt, axis=0), np.repeat(second["text_embeds"], per_prompt, axis=0)
