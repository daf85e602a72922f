"""Qwen-Image-Edit, with the semantics of diffusers' QwenImageEditPipeline (one input image) and
QwenImageEditPlusPipeline (several; Qwen-Image-Edit-2509): the instruction and the input images through
Qwen2.5-VL (its vision tower, then its language model with the images' tokens in the prompt: the Edit template,
64 leading tokens' states dropped), and each input image's latents after the image's on the transformer's token
axis (runners/families/qwen_image: `References`); otherwise Qwen-Image's loop, true CFG and schedule.

The images are sized as the pipelines size them: for the VAE, about 1024 x 1024 pixels at the image's aspect
ratio (sides multiples of 32, LANCZOS); for the vision tower, Edit's the same picture and EditPlus's about
384 x 384; Qwen2VLProcessor then resizes those to multiples of 28 (runners/families/qwen_image_edit/vision.py). The
output size left unset is the (last) input image's 1024 x 1024 one.

The language model's rotary positions are Qwen2.5-VL's 3D ones around the image tokens (get_rope_index), which
the model was trained with. diffusers' pipelines lose them with transformers 5 (the processor's
mm_token_type_ids are not passed on: diffusers #14194, fix open in #14189), which changes the prompt's states;
this runner keeps them."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from runners.adapters.lora import register_key_spelling
from runners.families.qwen_image import lora_keys
from runners.families.qwen_image import FRAME_AXIS, REFERENCE, QwenImagePipeline, References, _without_frame
from runners.families.qwen_image_edit.vision import (VisionConfig, image_tokens, merged_in_order, mrope_positions,
                                                pixel_patches, vision_layout)
from runners.options import IMAGE_TASKS, MAX_SEQUENCE_LENGTH, REQUEST, Option, options
from runners.prompts import POST_STEPS, Encoded
from runners.text_to_image import INPAINT, TEXT, Defaults, _prompts, given_or_drawn

VISION_PAD = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
PICTURE = "Picture {}: " + VISION_PAD  # QwenImageEditPlusPipeline's, before each image
CONDITION_AREA = 384 * 384  # QwenImageEditPlusPipeline's vision-tower images


def calculate_dimensions(area: int, ratio: float) -> tuple[int, int]:
    """diffusers' calculate_dimensions: (width, height) of about `area` pixels at `ratio`, multiples of 32."""
    width = math.sqrt(area * ratio)
    return round(width / 32) * 32, round(width / ratio / 32) * 32


def _images(image, several: bool, most: int) -> list:
    from PIL import Image

    images = list(image) if isinstance(image, (list, tuple)) else [] if image is None else [image]
    if not images or not all(isinstance(i, Image.Image) for i in images):
        raise ValueError("image= is required: Qwen-Image-Edit edits input images (PIL images); text to image is "
                         "the qwen-image model's")
    if len(images) > (most if several else 1):
        raise ValueError(f"{len(images)} input images: " + (f"this artifact takes 1 to {most} (its token range)"
                         if several else "QwenImageEditPipeline takes one (Qwen-Image-Edit-2509's "
                         "QwenImageEditPlusPipeline takes several)"))
    return images


class QwenImageEditPipeline(QwenImagePipeline):
    family = "qwen_image_edit"
    # QwenImageEditPipeline's and QwenImageEditInpaintPipeline's signature defaults
    defaults = {TEXT: Defaults(50, 4.0), INPAINT: Defaults(50, 4.0, 0.6)}
    options = options(REQUEST, QwenImagePipeline.guidance.options, (
        Option("image", "image", "the input image to edit (required); Qwen-Image-Edit-2509's pipeline takes up to 3 "
               "(the CLI's --image repeated), the last setting the size left unset", repeat=True, group="image"),
        replace(MAX_SEQUENCE_LENGTH, default=512, within=lambda v: 1 <= v <= 1024, allowed="an integer from 1 to 1024",
                help="checked as diffusers checks it; the Edit pipelines read every token of the prompt"),
        *(o for o in QwenImagePipeline.options if o.name in ("guidance_scale", "sigmas")),
        *(replace(o, help="QwenImageEditInpaintPipeline: " + o.help) for o in IMAGE_TASKS if o.name != "image"),
    ))

    def generate(self, prompt, image=None, negative_prompt=None, true_cfg_scale=4.0, height=None, width=None,
                 num_inference_steps=None, sigmas=None, guidance_scale=None, num_images_per_prompt=1, seed=None,
                 latents=None, output_type="pil", max_sequence_length=512, vae_tiling=None, mask_image=None,
                 strength=None, noise=None, encoder_noise=None):
        """Edit `image` (one PIL image; a list for Qwen-Image-Edit-2509) as the `prompt` instructs. The size left
        unset is the (last) input image's at about 1024 x 1024 pixels. Classifier-free guidance runs only with a
        `negative_prompt` and `true_cfg_scale` above 1, as in diffusers. `latents` are packed, (N, h/2 * w/2, 64).
        With `mask_image`, QwenImageEditInpaintPipeline: only the mask's white part of the image is edited, from
        `strength` (default 0.6), at the image's size; `noise` and `encoder_noise` as Qwen-Image's inpainting takes
        them, the image's VAE sample (`encoder_noise`) being its reference too."""
        self._check_text_options(guidance_scale, max_sequence_length)
        c = self.constants
        images = _images(image, c["several_images"], c["references"])
        if mask_image is not None:
            return self._inpaint(prompt, images, mask_image, negative_prompt, true_cfg_scale, height, width,
                                 num_inference_steps, sigmas, num_images_per_prompt, seed, latents, output_type,
                                 max_sequence_length, vae_tiling, strength, noise, encoder_noise)
        given = [n for n, v in (("strength", strength), ("noise", noise), ("encoder_noise", encoder_noise))
                 if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: inpainting's (QwenImageEditInpaintPipeline); pass mask_image= too")
        ratio = images[-1].width / images[-1].height
        width, height = (given or calculated for given, calculated in
                         zip((width, height), calculate_dimensions(c["image_area"], ratio)))
        multiple = c["vae_scale_factor"] * c["latent_multiple"]
        height, width = height // multiple * multiple, width // multiple * multiple
        if latents is not None:
            latents = self._given_latents(latents, height, width, output_type, "QwenImageEditPipeline")
        vae_images, vision_images = self._sized(images)
        with self._timed("vae_encode"):
            references = self._references(vae_images, vae_tiling)
        result = self._text_to_image(prompt, negative_prompt, height, width, num_inference_steps,
                                     true_cfg_scale if negative_prompt is not None else 1.0, num_images_per_prompt,
                                     seed, latents, output_type, vae_tiling, sigmas=sigmas,
                                     vision_images=vision_images, references=references)
        return self.layout.as_diffusers(result) if output_type == "latent" else result

    @property
    def vision_config(self) -> VisionConfig:
        return VisionConfig(**self.constants["vision"])

    def calibration_options(self, image, index: int) -> dict:
        """Every calibration call edits its picture: the Edit pipelines take no call without one."""
        from PIL import Image

        return {"image": Image.fromarray(np.round(image * 255).astype(np.uint8))}

    def _sized(self, images) -> tuple[list, list]:
        """The images for the VAE and for the vision tower, as the pipeline resizes them (LANCZOS)."""
        from PIL import Image

        area = self.constants["image_area"]
        vae = [i.resize(calculate_dimensions(area, i.width / i.height), Image.Resampling.LANCZOS) for i in images]
        if not self.constants["several_images"]:
            return vae, vae  # QwenImageEditPipeline: the same picture
        return vae, [i.resize(calculate_dimensions(CONDITION_AREA, i.width / i.height), Image.Resampling.LANCZOS)
                     for i in images]

    def _inpaint(self, prompt, images, mask_image, negative_prompt, true_cfg_scale, height, width, num_inference_steps,
                 sigmas, num_images_per_prompt, seed, latents, output_type, max_sequence_length, vae_tiling, strength,
                 noise, encoder_noise):
        """QwenImageEditInpaintPipeline: the image, at its own size of about 1024 x 1024 pixels, is the reference to
        edit and inpainting's image; its reference tokens are the same VAE sample that inpainting starts from and
        blends back (the loop's draws: the image's sample, then the noise, as every inpainting call draws them)."""
        if self.constants["several_images"]:
            raise ValueError("mask_image: Qwen-Image-Edit-2509's pipeline (QwenImageEditPlusPipeline) has no "
                             "inpainting; inpaint with a Qwen-Image-Edit artifact")
        refused = [n for n, v in (("height", height), ("width", width), ("latents", latents)) if v is not None]
        if refused:
            raise ValueError(f"{', '.join(refused)}: QwenImageEditInpaintPipeline paints at the image's size (about "
                             "1024 x 1024 pixels at its aspect ratio) from the image: resize the image instead, and "
                             "pass noise= to fix the starting noise")
        (vae_image,), vision_images = self._sized(images)
        height, width = vae_image.height, vae_image.width
        rng = np.random.default_rng(seed)
        n_images = len(_prompts("prompt", prompt)) * num_images_per_prompt
        shape = self.layout.shape(self, n_images, height, width)
        encoder_noise, noise = (given_or_drawn(name, _without_frame(name, value, FRAME_AXIS[name]), drawn, rng)
                                for name, value, drawn in (("encoder_noise", encoder_noise, (1, *shape[1:])),
                                                           ("noise", noise, shape)))
        with self._timed("vae_encode"):
            references = self._references([vae_image], vae_tiling, encoder_noise)
        result = self._text_to_image(prompt, negative_prompt, height, width, num_inference_steps,
                                     true_cfg_scale if negative_prompt is not None else 1.0, num_images_per_prompt,
                                     seed, None, output_type, vae_tiling, image=images[0], mask_image=mask_image,
                                     strength=strength, noise=noise, encoder_noise=encoder_noise, sigmas=sigmas,
                                     vision_images=vision_images, references=references)
        return self.layout.as_diffusers(result) if output_type == "latent" else result

    def _references(self, images, vae_tiling, encoder_noise=None) -> References:
        """Each image's latents (its posterior's mode, normalised; with `encoder_noise`, that sample of it, as the
        inpainting pipeline reads its image), packed, as frames 1, 2, ... after the image."""
        from runners.conditioning.images import to_model_input

        tokens, ids, shapes = [], [], []
        for i, image in enumerate(images):
            pixels = to_model_input(image, image.height, image.width, self.constants["vae_scale_factor"])
            posterior = self.vae_encode(pixels, tiling=vae_tiling)
            latent = posterior[0] if encoder_noise is None else self._posterior_latents(posterior, encoder_noise)
            rows, cols = latent.shape[2] // self.layout.patch, latent.shape[3] // self.layout.patch
            tokens.append(self.layout.pack(latent))
            ids.append(self.layout.positions(rows, cols, index=i + 1))
            shapes.append((rows, cols))
        return References(np.concatenate(tokens, axis=1), np.concatenate(ids), shapes)

    def _conditions(self, prompts, negative_prompt, per_prompt, cfg, height, width, vision_images, references):
        """The prompts' states read with the input images (Qwen-Image's `_prompt_states`) and the images' tokens."""
        most = self.dims["image_tokens"][2]
        total = (height // self.constants["vae_scale_factor"] // 2) * (width // self.constants["vae_scale_factor"] // 2)
        if total + len(references.ids) > most:
            raise ValueError(f"the image and its input images take {total + len(references.ids)} tokens, more than "
                             f"this artifact's {most}: pass fewer input images or a smaller height and width")
        vision = self._vision(vision_images)
        states = self._prompt_states(lambda texts: self._encode_with_images(texts, per_prompt, vision), prompts,
                                     negative_prompt, cfg)
        return {**states, REFERENCE: references}

    def _vision(self, images) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """The vision tower's merged tokens of every image, in order (tokens, width), and each image's patch grid."""
        config = self.vision_config
        patches = [pixel_patches(i, config) for i in images]
        layout = vision_layout(patches, config)
        rows = self.manifest["constants"]["window_rows"]  # a window's
        windows = len(layout.segments) // rows
        out = self.run("image_encoder", pixel_values=layout.pixel_values.reshape(windows, rows, -1),
                       positions=layout.positions.reshape(windows, rows, 2),
                       segments=layout.segments.reshape(windows, rows))
        merged = out["image_embeds"]
        return merged_in_order(merged.reshape(-1, merged.shape[-1]), layout), [grid for _, grid in patches]

    def _encode_with_images(self, prompts: list[str], per_prompt: int, vision) -> Encoded:
        """Each prompt after its images' placeholders (one <|image_pad|> a merged patch) through the language
        model with the images' tokens and 3D positions: the states after the template's dropped tokens."""
        merged, grids = vision
        config = self.vision_config
        pads = [IMAGE_PAD * image_tokens(g, config) for g in grids]
        section = "".join(PICTURE.format(i + 1) for i in range(len(grids))) if self.constants["several_images"] \
            else VISION_PAD
        section = section.split(IMAGE_PAD)
        text = "".join(part + pad for part, pad in zip(section, pads + [""]))
        tok = self.tokenizers["tokenizer"]
        most = self.dims["text_length"][2]
        tokens = tok.encode([text + p for p in prompts], most + 1)
        if tokens.ids.shape[1] > most:
            raise ValueError(f"the prompt and its input images take {int(tokens.lengths.max())} tokens, more than this "
                             f"artifact's {most}: shorten the prompt or pass fewer input images")
        image_token = self.constants["image_token_id"]
        states = np.zeros((*tokens.ids.shape, merged.shape[-1]), dtype=np.float32)
        states[tokens.ids == image_token] = np.tile(merged, (len(prompts), 1))
        out = self.run("text_encoder", input_ids=tokens.ids, attention_mask=tokens.mask,
                       position_ids=mrope_positions(tokens.ids, tokens.mask, image_token, grids, config),
                       image_states=states)
        encoded = POST_STEPS["repadded"](Encoded(out["hidden_states"][:, tok.drop_tokens:],
                                                 tokens.mask[:, tok.drop_tokens:]))
        return Encoded(*(np.repeat(a, per_prompt, axis=0) for a in encoded))


register_key_spelling("qwen_image_edit", lora_keys.to_diffusers_names)  # Qwen-Image's transformer: its spellings
