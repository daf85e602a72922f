"""Qwen-Image 2.1, text to image, with the semantics of diffusers' QwenImage21Pipeline: each prompt (an empty one
as " ") in the pipeline's template through Qwen3-VL's language model, read before its final norm, the template's
system turn dropped and the rest padded to the call's longest prompt with a mask (runners/prompts.py's
"repadded"); the prompt's keys and values in every transformer block computed once a call (`transformer_prefix`),
then each step the transformer on the image's tokens alone (export/families/qwen_image21.py); true CFG only
with a negative prompt and `true_cfg_scale` above 1 (runners/guidance.py's TRUE_CFG; no rescale); the sigmas
from 1 to 1 / steps, or the folder's `sample_sigmas` (Turbo's), shifted by the image's tokens.

The loop works on the latents unpacked, (N, 64, h, w) for an image of 16h x 16w pixels (a token is one latent
pixel); `latents=` are packed, as diffusers takes them: (N, h * w, 64). The images are RGBA."""
from __future__ import annotations

import logging

import numpy as np

from runners.families.qwen_image import padded
from runners.guidance import TRUE_CFG
from runners.latents import LatentLayout, positions
from runners.options import REQUEST, Option, options
from runners.prompts import Encoded, encode_prompts
from runners.text_to_image import TEXT, Defaults, TextToImage


log = logging.getLogger("runners")


class QwenImage21Pipeline(TextToImage):
    family = "qwen_image21"
    layout = LatentLayout(packed_latents=True, positions=positions.qwen)  # a token a latent pixel (64 channels)
    guidance = TRUE_CFG
    defaults = {TEXT: Defaults(40, 1.0)}  # QwenImage21Pipeline's: 40 steps, no guidance
    options = options(REQUEST, guidance.options, (
        Option("sigmas", "array", "the schedule's sigmas, one a step (default: the folder's sample_sigmas, else 1 "
               "to 1 / steps)", cli=False),
    ))

    def generate(self, prompt, negative_prompt=None, true_cfg_scale=1.0, height=None, width=None,
                 num_inference_steps=None, sigmas=None, num_images_per_prompt=1, seed=None, latents=None,
                 output_type="pil", vae_tiling=None):
        """Generate RGBA images (call the pipeline: `pipe(prompt, ...)`). Classifier-free guidance runs only with a
        `negative_prompt` and `true_cfg_scale` above 1, as in diffusers (the model is meant to run without).
        `latents` are packed, as QwenImage21Pipeline takes them: (N, h * w, 64) for an image of 16h x 16w
        pixels. `sigmas` (or the folder's sample_sigmas) set the steps, as there."""
        if true_cfg_scale > 1 and negative_prompt is None:  # diffusers' warnings
            log.warning("true_cfg_scale=%s does nothing without a negative_prompt: classifier-free guidance is off",
                        true_cfg_scale)
        elif true_cfg_scale <= 1 and negative_prompt is not None:
            log.warning("negative_prompt does nothing with true_cfg_scale <= 1: classifier-free guidance is off")
        if sigmas is None:
            sigmas = self.constants.get("sample_sigmas")
        if latents is not None:
            latents = self._given_latents(latents, height, width, output_type, "QwenImage21Pipeline")
        result = self._text_to_image(
            prompt, negative_prompt, height, width, num_inference_steps,
            true_cfg_scale if negative_prompt is not None else 1.0, num_images_per_prompt, seed, latents,
            output_type, vae_tiling, sigmas=sigmas)
        return self.layout.as_diffusers(result) if output_type == "latent" else result

    def _conditions(self, prompts, negative_prompt, per_prompt, cfg, height, width) -> dict:
        """Each branch's prompts padded to its longest (the image's rotary frame follows it, `frames`); with
        guidance, the negative prompts' before (both padded to the longer: the padding is masked out); their keys
        and values in every block, from `transformer_prefix`."""
        branches = [self._encode(prompts, per_prompt)]
        if cfg:
            branches = [self._encode(self._negatives(prompts, negative_prompt), per_prompt), *branches]
        length = max(b.embeds.shape[1] for b in branches)
        frames = np.concatenate([np.full(len(b.mask), b.embeds.shape[1], np.float32) for b in branches])
        embeds, mask = (np.concatenate(parts) for parts in zip(*(padded(b, length) for b in branches)))
        txt_ids = np.repeat(np.arange(length, dtype=np.float32)[:, None], 3, axis=1)
        prefix = self.run("transformer_prefix", release=True, encoder_hidden_states=embeds,
                          encoder_hidden_states_mask=mask, txt_ids=txt_ids, timestep=np.zeros(1, np.float32))
        return {"prefix_keys": prefix["prefix_keys"], "prefix_values": prefix["prefix_values"],
                "encoder_hidden_states_mask": mask, "frames": frames}

    def _encode(self, prompts: list[str], per_prompt: int) -> Encoded:
        """The states after the template's system turn, padded to the longest prompt, repeated for its images. An
        empty prompt (a negative one too) is read as " ", as diffusers reads it (Qwen has no start token)."""
        longest = self.dims["text_length"][2]  # diffusers never truncates; the artifact's range holds the prompt
        prompts = [p or " " for p in prompts]
        encoded = encode_prompts(self, "text_encoder", "processor", prompts, longest, post="repadded")
        return Encoded(*(np.repeat(a, per_prompt, axis=0) for a in encoded))

    def _predict(self, x, t, conditions: dict, release: bool, engine: str | None = None, **extra) -> dict:
        """The transformer on the image's tokens at timestep t / 1000 (as the pipeline feeds it), each image's
        rotary frame after its branch's prompts, reading the prompts' keys and values."""
        n, _, h, w = x.shape
        feeds = {k: v for k, v in conditions.items() if k != "frames"}
        img_ids = np.stack([self.layout.positions(h, w, frame) for frame in conditions["frames"]])
        out = self.run(engine or "transformer", release=release, hidden_states=self.layout.pack(x),
                       timestep=np.full(n, t, dtype=np.float32) / np.float32(1000), img_ids=img_ids, **feeds, **extra)
        return {**out, "noise_pred": self.layout.unpack(out["noise_pred"], (h, w))}
