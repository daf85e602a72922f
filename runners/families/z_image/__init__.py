"""Z-Image and Z-Image-Turbo, with the semantics of diffusers' ZImagePipeline (and its Img2Img and Inpaint
pipelines): each prompt through Qwen3's chat template, its own tokens' second-to-last hidden states (no
padding: runners/prompts.py), the transformer on latents with the timestep as (1000 - t) / 1000 and its
prediction negated, Z-Image's guidance (the prompt's half first, on above 0, with `cfg_normalization` and
`cfg_truncation`: runners/guidance.py), and FLUX.1's VAE; its ControlNets as runners/families/z_image/controlnet.py
runs them."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from runners.adapters.lora import register_key_spelling
from runners.conditioning.controlnet import CONTROL_OPTIONS, CONTROLNETS
from runners.families.z_image import lora_keys
from runners.families.z_image.controlnet import ZImageControlNets
from runners.guidance import NormalizedCFG
from runners.options import IMAGE_TASKS, MAX_SEQUENCE_LENGTH, REQUEST, options
from runners.prompts import encode_prompts
from runners.text_to_image import IMAGE, INPAINT, TEXT, Defaults, TextToImage


def _padded(captions: list[np.ndarray], length: int) -> tuple[np.ndarray, np.ndarray]:
    batch = np.zeros((len(captions), length, captions[0].shape[1]), dtype=np.float32)
    for row, c in zip(batch, captions):
        row[:len(c)] = c
    return batch, np.array([len(c) for c in captions], dtype=np.int64)


class ZImagePipeline(ZImageControlNets, TextToImage):
    family = "z_image"
    guidance = NormalizedCFG()
    # diffusers' defaults (its text-to-image, Img2Img and Inpaint pipelines'); Turbo's model card: 8 steps,
    # no guidance (its pipeline's `num_inference_steps=9` counts one step whose sigma is 0)
    defaults = {TEXT: Defaults(50, 5.0), IMAGE: Defaults(50, 5.0, 0.6), INPAINT: Defaults(50, 5.0, 1.0)}
    turbo_defaults = {TEXT: Defaults(8, 0.0), IMAGE: Defaults(8, 0.0, 0.6), INPAINT: Defaults(8, 0.0, 1.0)}
    options = options(REQUEST, guidance.options, (replace(MAX_SEQUENCE_LENGTH, default=512, help="Qwen3 tokens of a "
                                                          "prompt, its chat template's included"),), IMAGE_TASKS,
                      CONTROL_OPTIONS)
    image_sets_size = (IMAGE, INPAINT)
    strength_whole_steps = False  # diffusers' get_timesteps rounds the steps skipped down (as SD3's)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.constants.get("variant") == "turbo":
            self.defaults = self.turbo_defaults

    def generate(self, prompt, negative_prompt=None, height=None, width=None, num_inference_steps=None,
                 guidance_scale=None, num_images_per_prompt=1, seed=None, latents=None, output_type="pil",
                 vae_tiling=None, image=None, mask_image=None, strength=None, noise=None, encoder_noise=None,
                 cfg_normalization=0.0, cfg_truncation=1.0, max_sequence_length=512, control_image=None,
                 controlnet_conditioning_scale=None, control_guidance_start=0.0, control_guidance_end=1.0):
        """Generate images (call the pipeline: `pipe(prompt, ...)`); from an `image` too (image to image, with
        `strength`), and a `mask_image` (inpainting). Steps, guidance and strength left None take the
        variant's defaults (Turbo: 8 steps, guidance 0). `latents` as ZImagePipeline takes them (N, 16, h, w).
        `cfg_normalization` and `cfg_truncation`: see runners/guidance.py's NormalizedCFG.
        On an artifact exported with ControlNets, `control_image` (one per ControlNet) and the other ControlNet
        settings are those of diffusers' ZImageControlNetPipeline (scale 0.75 by default), and with `image` and
        `mask_image` its inpainting twin's, whose 2.x ControlNet repaints the masked part of `image` from noise
        (runners/families/z_image/controlnet.py)."""
        lo, _, hi = self.dims["text_length"]
        if not lo <= max_sequence_length <= hi:
            raise ValueError(f"max_sequence_length={max_sequence_length} is outside this artifact's range {lo}..{hi}")
        return self._controlled_text_to_image(
            prompt, negative_prompt, height, width, num_inference_steps, guidance_scale, num_images_per_prompt, seed,
            latents, output_type, vae_tiling, image=image, mask_image=mask_image, strength=strength, noise=noise,
            encoder_noise=encoder_noise, max_length=max_sequence_length, cfg_normalization=cfg_normalization,
            cfg_truncation=cfg_truncation, control_image=control_image,
            controlnet_conditioning_scale=controlnet_conditioning_scale, control_guidance_start=control_guidance_start,
            control_guidance_end=control_guidance_end)

    def _conditions(self, prompts, negative_prompt, per_prompt, cfg, height, width, max_length, control=None):
        """The captions right-padded to the longest of the batch, and each one's length: the transformer pads
        each to its own multiple of 32 (export/families/z_image.py)."""
        captions = self._encode(prompts, per_prompt, max_length)
        negatives = self._encode(self._negatives(prompts, negative_prompt), per_prompt, max_length) if cfg else []
        longest = max(len(c) for c in captions + negatives)
        caption, lengths = _padded(captions, longest)
        if cfg:
            neg_caption, neg_lengths = _padded(negatives, longest)
            caption, lengths = self.guidance.batch(caption, neg_caption), self.guidance.batch(lengths, neg_lengths)
        return {"caption": caption, "caption_lengths": lengths,
                **self._control_conditions(control, height, width, len(prompts) * per_prompt, per_prompt, cfg)}

    def _encode(self, prompts: list[str], per_prompt: int, max_length: int) -> list[np.ndarray]:
        """Each prompt's own tokens' hidden states, each repeated for its images (diffusers' order)."""
        trimmed = encode_prompts(self, "text_encoder", "tokenizer", prompts, max_length, post="trimmed")
        return [e for e in trimmed for _ in range(per_prompt)]

    def hidden_tokens(self, sides: tuple, conditions: dict) -> int:
        """The blocks' stream: the image's patches, then the batch's longest caption, each padded to a multiple
        of 32 (the manifest's `token_multiple`: export/families/z_image.py)."""
        multiple = self.constants["token_multiple"]
        image, caption = super().hidden_tokens(sides, conditions), conditions["caption"].shape[1]
        return sum(-(-n // multiple) * multiple for n in (image, caption))

    def _predict(self, x, t, conditions: dict, release: bool, engine: str | None = None, **extra) -> dict:
        """The transformer on the latents at timestep (1000 - t) / 1000, its prediction negated (as the
        pipeline feeds and reads it); the ControlNets' residuals added."""
        timestep = np.full(x.shape[0], (np.float32(1000) - np.float32(t)) / np.float32(1000), dtype=np.float32)
        feeds = {k: v for k, v in conditions.items() if k != CONTROLNETS}
        residuals = self._control_residuals(engine, x, timestep, feeds, release, conditions.get(CONTROLNETS))
        out = self.run(engine or "transformer", release=release, latent=x, timestep=timestep, **feeds, **residuals,
                       **extra)
        return {**out, "noise_pred": -out["noise_pred"]}


register_key_spelling("z_image", lora_keys.to_diffusers_names)  # adapters in the original checkpoint's names
