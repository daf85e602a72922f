"""Qwen-Image, with the semantics of diffusers' QwenImagePipeline, QwenImageImg2ImgPipeline and
QwenImageInpaintPipeline: each prompt in the pipeline's template through Qwen2.5-VL's language model, the
template's first 34 tokens' states dropped and the rest padded to the call's longest prompt with a mask
(runners/prompts.py's "repadded"); the transformer on the latents packed in 2 x 2 patches (FLUX.1's packing:
runners/latents/) with their rotary positions (runners/latents/positions.py's `qwen`); true CFG only with a
negative prompt and `true_cfg_scale` above 1, each guided token rescaled to the norm of the prompt's
(runners/guidance.py's RescaledTrueCFG); FLUX.1's flow-matching sigmas shifted by the image's tokens.

The loop works on unpacked, normalised latents (N, 16, h, w): the VAE's graphs hold the per-channel mean and
standard deviation and run the causal 3D VAE on one frame (export/families/qwen_image.py). `latents=` are
packed, as diffusers takes them; the image tasks' `noise=` and `encoder_noise=` also take diffusers' draws with
their frame axis ((N, 1, 16, h, w) and (N, 16, 1, h, w))."""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from runners.adapters.lora import register_key_spelling
from runners.conditioning.controlnet import CONTROL_NOISE, CONTROL_OPTIONS, CONTROLNETS
from runners.families.qwen_image import lora_keys
from runners.families.qwen_image.controlnet import QwenImageControlNets
from runners.guidance import QWEN_TRUE_CFG
from runners.latents import LatentLayout, positions
from runners.options import IMAGE_TASKS, MAX_SEQUENCE_LENGTH, REQUEST, Option, options
from runners.prompts import Encoded, encode_prompts
from runners.text_to_image import IMAGE, INPAINT, TEXT, Defaults, TextToImage

log = logging.getLogger("runners")
REFERENCE = "references"  # the conditions' entry of the Edit pipelines' input images (runners/families/qwen_image_edit)


class References(NamedTuple):
    """Input images' tokens after the image's: packed latents (1, n, 64), their rotary positions (n, 3), and
    each image's token grid (rows, cols)."""
    tokens: np.ndarray
    ids: np.ndarray
    shapes: list[tuple[int, int]]

# QwenImagePipeline's and its Img2Img and Inpaint twins' signature defaults (the scale is true_cfg_scale's)
DEFAULTS = {TEXT: Defaults(50, 4.0), IMAGE: Defaults(50, 4.0, 0.6), INPAINT: Defaults(50, 4.0, 0.6)}
# diffusers' frame axis in the image tasks' draws: the noise is drawn (N, 1, z, h, w), the posteriors (N, z, 1, h, w)
FRAME_AXIS = {"noise": 1, "encoder_noise": 2, "control_noise": 2}


def _without_frame(name: str, value, axis: int):
    """diffusers' draw with its frame axis of one frame, as the loop takes it (4-D draws pass as they are)."""
    if value is None:
        return None
    value = np.asarray(value, dtype=np.float32)
    if value.ndim == 5:
        if value.shape[axis] != 1:
            raise ValueError(f"{name} has shape {value.shape}: its frame axis ({axis}) must be 1 (Qwen-Image makes "
                             "one frame)")
        value = value.squeeze(axis)
    return value


def padded(encoded: Encoded, length: int) -> Encoded:
    """The states and mask padded with zeros to `length` tokens."""
    extra = length - encoded.embeds.shape[1]
    return Encoded(np.pad(encoded.embeds, ((0, 0), (0, extra), (0, 0))), np.pad(encoded.mask, ((0, 0), (0, extra))))


class QwenImagePipeline(QwenImageControlNets, TextToImage):
    layout = LatentLayout(packed_latents=True, positions=positions.qwen)
    family = "qwen_image"
    guidance = QWEN_TRUE_CFG
    defaults = DEFAULTS
    image_sets_size = ()  # every Qwen-Image pipeline renders at the requested (or the default) size
    strength_whole_steps = False  # get_timesteps rounds the steps skipped down (as SD3's)
    options = options(REQUEST, guidance.options, (
        replace(MAX_SEQUENCE_LENGTH, default=512, within=lambda v: v >= 1, allowed="an integer from 1 to 1024",
                help="the text encoder's states kept per prompt, after the template's dropped tokens"),
        Option("guidance_scale", "float", "ignored, as diffusers ignores it: Qwen-Image's transformer has no guidance "
               "embedding (classifier-free guidance is true_cfg_scale's, with a negative prompt)", cli=False),
        Option("sigmas", "array", "the schedule's sigmas, one a step (default: 1 to 1 / steps)", cli=False),
    ), IMAGE_TASKS, CONTROL_OPTIONS, (CONTROL_NOISE,))

    def generate(self, prompt, negative_prompt=None, true_cfg_scale=4.0, height=None, width=None,
                 num_inference_steps=None, sigmas=None, guidance_scale=None, num_images_per_prompt=1, seed=None,
                 latents=None, output_type="pil", max_sequence_length=512, vae_tiling=None, image=None,
                 mask_image=None, strength=None, noise=None, encoder_noise=None, control_image=None,
                 controlnet_conditioning_scale=None, control_guidance_start=0.0, control_guidance_end=1.0,
                 control_noise=None):
        """Generate images (call the pipeline: `pipe(prompt, ...)`); from an `image` too (image to image, with
        `strength`, default 0.6), and a `mask_image` (inpainting). Classifier-free guidance runs only with a
        `negative_prompt` and `true_cfg_scale` above 1 (default 4), as in diffusers. `latents` are packed, as
        QwenImagePipeline takes them: (N, h/2 * w/2, 64) for latent sides h, w. On an artifact exported with
        ControlNets, `control_image` (one per ControlNet) and the other ControlNet settings are those of diffusers'
        QwenImageControlNetPipeline (runners/families/qwen_image/controlnet.py); with inpainting ControlNets
        (QwenImageControlNetInpaintPipeline's), `mask_image` is their mask (diffusers' `control_mask`)."""
        self._check_text_options(guidance_scale, max_sequence_length)
        # the artifact's text range may hold fewer: a longer prompt is truncated there, with a warning
        max_sequence_length = min(max_sequence_length,
                                  self.dims["text_length"][2] - self.tokenizers["tokenizer"].drop_tokens)
        if latents is not None:
            latents = self._given_latents(latents, height, width, output_type, "QwenImagePipeline")
        noise, encoder_noise = (_without_frame(name, value, FRAME_AXIS[name])
                                for name, value in (("noise", noise), ("encoder_noise", encoder_noise)))
        if isinstance(control_noise, (list, tuple)):  # one per ControlNet
            control_noise = [_without_frame("control_noise", c, FRAME_AXIS["control_noise"]) for c in control_noise]
        else:
            control_noise = _without_frame("control_noise", control_noise, FRAME_AXIS["control_noise"])
        result = self._controlled_text_to_image(
            prompt, negative_prompt, height, width, num_inference_steps,
            true_cfg_scale if negative_prompt is not None else 1.0, num_images_per_prompt, seed, latents, output_type,
            vae_tiling, image=image, mask_image=mask_image, strength=strength, noise=noise,
            encoder_noise=encoder_noise, sigmas=sigmas, max_length=max_sequence_length, control_image=control_image,
            controlnet_conditioning_scale=controlnet_conditioning_scale, control_guidance_start=control_guidance_start,
            control_guidance_end=control_guidance_end, control_noise=control_noise)
        return self.layout.as_diffusers(result) if output_type == "latent" else result

    def _check_text_options(self, guidance_scale, max_sequence_length) -> None:
        """diffusers' warning for guidance_scale and its range for max_sequence_length."""
        if guidance_scale is not None:
            log.warning("guidance_scale=%s is ignored: Qwen-Image's transformer is not guidance-distilled (use "
                        "true_cfg_scale with a negative_prompt)", guidance_scale)
        if not 1 <= max_sequence_length <= self.constants["max_text"]:
            raise ValueError(f"max_sequence_length={max_sequence_length} is not allowed: Qwen-Image keeps 1 to "
                             f"{self.constants['max_text']} states per prompt")

    def _conditions(self, prompts, negative_prompt, per_prompt, cfg, height, width, max_length, control=None):
        """The prompts' states and masks (`_prompt_states`); the call's ControlNets."""
        states = self._prompt_states(lambda texts: self._encode(texts, per_prompt, max_length), prompts,
                                     negative_prompt, cfg)
        n_images = len(prompts) * per_prompt
        return {**states, **self._control_conditions(control, height, width, n_images, per_prompt, cfg)}

    def _prompt_states(self, encode, prompts, negative_prompt, cfg) -> dict:
        """`encode`(texts) -> each prompt's states and mask, repeated for its images; with guidance, the negative
        prompts' after (both padded to the longer: the padding is masked out)."""
        encoded = encode(prompts)
        if cfg:
            negatives = encode(self._negatives(prompts, negative_prompt))
            length = max(encoded.embeds.shape[1], negatives.embeds.shape[1])
            encoded, negatives = padded(encoded, length), padded(negatives, length)
            encoded = Encoded(*(self.guidance.batch(p, n) for p, n in zip(encoded, negatives)))
        return {"encoder_hidden_states": encoded.embeds, "encoder_hidden_states_mask": encoded.mask}

    def _encode(self, prompts: list[str], per_prompt: int, max_length: int) -> Encoded:
        """The states after the template's dropped tokens, at most `max_length` a prompt (the encoder is causal:
        the tokens past those change none of them)."""
        drop = self.tokenizers["tokenizer"].drop_tokens
        encoded = encode_prompts(self, "text_encoder", "tokenizer", prompts, drop + max_length, post="repadded")
        return Encoded(*(np.repeat(a, per_prompt, axis=0) for a in encoded))

    def hidden_tokens(self, sides: tuple, conditions: dict) -> int:
        """The image's tokens, and the Edit pipelines' input images' after them."""
        references = conditions.get(REFERENCE)
        return super().hidden_tokens(sides, conditions) + (0 if references is None else len(references.ids))

    def _predict(self, x, t, conditions: dict, release: bool, engine: str | None = None, **extra) -> dict:
        """The transformer on the packed latents (the Edit pipelines' input images' tokens after them), its
        timestep divided by 1000 (as the pipeline feeds it), with the tokens' and the text's rotary positions and
        the ControlNets' residuals: its outputs, `noise_pred` the image's tokens' unpacked."""
        n, _, h, w = x.shape
        rows, cols = h // self.layout.patch, w // self.layout.patch
        feeds = {k: v for k, v in conditions.items() if k not in (CONTROLNETS, REFERENCE)}
        tokens, timestep = self.layout.pack(x), np.full(n, t, dtype=np.float32) / np.float32(1000)
        img_ids, shapes = self.layout.positions(rows, cols), [(rows, cols)]
        references = conditions.get(REFERENCE)
        if references is not None:
            tokens = np.concatenate([tokens, np.repeat(references.tokens, n, axis=0)], axis=1)
            img_ids, shapes = np.concatenate([img_ids, references.ids]), shapes + references.shapes
        ids = {"img_ids": img_ids, "txt_ids": positions.qwen_text(feeds["encoder_hidden_states"].shape[1], shapes)}
        controlnets = conditions.get(CONTROLNETS)
        residuals = self._control_residuals(engine, tokens, timestep, feeds, release, controlnets, **ids)
        out = self.run(engine or "transformer", release=release, hidden_states=tokens, timestep=timestep, **ids,
                       **feeds, **residuals, **extra)
        return {**out, "noise_pred": self.layout.unpack(out["noise_pred"], (h, w))}

register_key_spelling("qwen_image", lora_keys.to_diffusers_names)  # adapters in the trainers' module names
