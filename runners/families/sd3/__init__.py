"""Stable Diffusion 3 text-to-image, with the semantics of diffusers' StableDiffusion3Pipeline:
same prompt encoding, guidance, scheduler and VAE post-processing, so that the same weights
and the same starting latents give the same image."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from runners.families.sd3.controlnet import SD3ControlNets
from runners.conditioning.controlnet import CONTROL_NOISE, CONTROL_OPTIONS
from runners.options import IMAGE_TASKS, MAX_SEQUENCE_LENGTH, REQUEST, options
from runners.latents import LatentLayout
from runners.text_to_image import IMAGE, INPAINT, TEXT, Defaults, TextToImage


class SD3Pipeline(SD3ControlNets, TextToImage):
    family = "sd3"
    # ComfyUI's latent_rgb_factors and bias for SD3's latents (runners/preview.py)
    layout = LatentLayout(latent_rgb={16: (
        [[-0.0922, -0.0175, 0.0749], [0.0311, 0.0633, 0.0954], [0.1994, 0.0927, 0.0458], [0.0856, 0.0339, 0.0902],
         [0.0587, 0.0272, -0.0496], [-0.0006, 0.1104, 0.0309], [0.0978, 0.0306, 0.0427],
         [-0.0042, 0.1038, 0.1358], [-0.0194, 0.0020, 0.0669], [-0.0488, 0.0130, -0.0268],
         [0.0922, 0.0988, 0.0951], [-0.0278, 0.0524, -0.0542], [0.0332, 0.0456, 0.0895],
         [-0.0069, -0.0030, -0.0810], [-0.0596, -0.0465, -0.0293], [-0.1448, -0.1463, -0.1189]],
        [0.2394, 0.2135, 0.1925])})
    # diffusers' defaults: its text-to-image, Img2Img and Inpaint pipelines'
    defaults = {TEXT: Defaults(28, 7.0), IMAGE: Defaults(50, 7.0, 0.6), INPAINT: Defaults(50, 7.0, 0.6)}
    options = options(REQUEST, TextToImage.guidance.options, (replace(MAX_SEQUENCE_LENGTH, default=256),), IMAGE_TASKS,
                      CONTROL_OPTIONS, (CONTROL_NOISE,))
    image_sets_size = ()
    strength_whole_steps = False
    # diffusers' StableDiffusion3InpaintPipeline decodes latents / scaling_factor without adding the
    # VAE's shift_factor back (its text-to-image and Img2Img pipelines add it): matched, so that the
    # same weights give the same image.
    inpaint_decode_adds_shift = False

    def generate(self, prompt, negative_prompt=None, height=None, width=None, num_inference_steps=None,
                 guidance_scale=None, num_images_per_prompt=1, seed=None, latents=None, output_type="pil",
                 max_sequence_length=256, vae_tiling=None, image=None, mask_image=None, strength=None, noise=None,
                 encoder_noise=None, control_image=None, controlnet_conditioning_scale=None, control_guidance_start=0.0,
                 control_guidance_end=1.0, control_noise=None):
        """Generate images (call the pipeline: `pipe(prompt, ...)`, which adds `profile=DIR`); from an
        `image` too (image to image, with `strength`), and a `mask_image` (inpainting). Steps, guidance
        and strength left None take `defaults`, those of diffusers' pipeline for the task.
        `seed` seeds numpy's generator (not torch's noise: the same seed gives other images than
        diffusers); pass `latents` for exact comparison across frameworks. `vae_tiling`: see `vae_decode`.
        `control_image` (one per ControlNet of the artifact) and the other ControlNet settings are those of
        diffusers' StableDiffusion3ControlNetPipeline, for text to image (runners/families/sd3/controlnet.py); the
        control images' VAE samples take `control_noise` (N, 16, h, w; under guidance 2N, both halves), a
        list of them for several ControlNets. With inpainting ControlNets (StableDiffusion3ControlNetInpainting-
        Pipeline's), `mask_image` is their mask (diffusers' `control_mask`) and `control_noise` is N."""
        if "text_encoder_3" in self.sessions:
            lo, _, hi = self.dims["text_length"]
            if not lo <= max_sequence_length <= hi:
                raise ValueError(f"max_sequence_length={max_sequence_length} is outside this artifact's range "
                                 f"{lo}..{hi}")
        return self._controlled_text_to_image(
            prompt, negative_prompt, height, width, num_inference_steps, guidance_scale, num_images_per_prompt, seed,
            latents, output_type, vae_tiling, image=image, mask_image=mask_image, strength=strength, noise=noise,
            encoder_noise=encoder_noise, text_length=max_sequence_length, control_image=control_image,
            controlnet_conditioning_scale=controlnet_conditioning_scale, control_guidance_start=control_guidance_start,
            control_guidance_end=control_guidance_end, control_noise=control_noise)

    def _conditions(self, prompts, negative_prompt, per_prompt, cfg, height, width, text_length, control=None):
        embeds, pooled = self._encode(prompts, per_prompt, text_length)
        if cfg:
            neg_embeds, neg_pooled = self._encode(self._negatives(prompts, negative_prompt), per_prompt, text_length)
            embeds, pooled = self.guidance.batch(embeds, neg_embeds), self.guidance.batch(pooled, neg_pooled)
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled,
                **self._control_conditions(control, height, width, len(prompts) * per_prompt, per_prompt, cfg)}

    def _encode(self, prompts: list[str], per_prompt: int, text_length: int):
        """diffusers' encode_prompt: penultimate CLIP-L and CLIP-G states side by side, zero-padded
        to the T5 width, then T5's states along the sequence; pooled: both CLIPs' projections."""
        c = self.constants
        hidden, pooled = [], []
        for name in ("text_encoder", "text_encoder_2"):
            tok = "tokenizer" if name == "text_encoder" else "tokenizer_2"
            out = self.run(name, input_ids=self.tokenizers[tok](prompts, c["clip_length"]))
            hidden.append(out["penultimate_hidden_states"])
            pooled.append(out["text_embeds"])
        clip = np.concatenate(hidden, axis=-1)
        width = c["joint_attention_dim"]
        clip = np.pad(clip, ((0, 0), (0, 0), (0, width - clip.shape[-1])))
        if "text_encoder_3" in self.sessions:
            ids = self.tokenizers["tokenizer_3"](prompts, text_length)
            t5 = self.run("text_encoder_3", input_ids=ids)["last_hidden_state"]
        else:  # a pipeline saved without T5: zeros, as diffusers does
            t5 = np.zeros((len(prompts), text_length, width), dtype=np.float32)
        embeds = np.concatenate([clip, t5], axis=1)
        pooled = np.concatenate(pooled, axis=-1)
        return np.repeat(embeds, per_prompt, axis=0), np.repeat(pooled, per_prompt, axis=0)
