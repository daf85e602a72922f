"""Qwen-Image 2.1, text to image, with the semantics of diffusers' QwenImage21Pipeline: each prompt (an empty one
as " ") in the pipeline's template through Qwen3-VL's language model, read before its final norm, the template's
system turn dropped and the rest padded to the call's longest prompt with a mask (runners/prompts.py's
"repadded"); the prompt's keys and values in every transformer block computed once a call (`transformer_prefix`),
then each step the transformer on the image's tokens alone (export/families/qwen_image21.py); true CFG only
with a negative prompt and `true_cfg_scale` above 1 (runners/guidance.py's TRUE_CFG; no rescale); the sigmas
from 1 to 1 / steps, or the folder's `sample_sigmas` (Turbo's), shifted by the image's tokens.

The loop works on the latents unpacked, (N, 64, h, w) for an image of 16h x 16w pixels (a token is one latent
pixel); `latents=` are packed, as diffusers takes them: (N, h * w, 64). The images are RGBA.

Reference images (`image=`, up to the artifact's 3), as the pipeline takes them: each resized to about
`output_resolution`² pixels at its aspect ratio (LANCZOS, as RGBA), read by Qwen3-VL (composited over white:
its vision tower, then the language model with the image's tokens and DeepStack features at the prompt's image
tokens, which come before the prompt) and by the VAE (RGBA, normalised). In the transformer, each image token of
the prompt stands for 2 x 2 of the reference's latent tokens, which take its place: the prefix is the prompt's
tokens and the references', in that order, the references' positions a frame after the text before them."""
from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np

from runners.families.qwen_image import padded
from runners.families.qwen_image21.vision import patch_positions
from runners.families.qwen_image_edit import IMAGE_PAD, calculate_dimensions
from runners.families.qwen_image_edit.vision import VisionConfig, image_tokens, mrope_positions, pixel_patches
from runners.guidance import TRUE_CFG
from runners.latents import LatentLayout, positions
from runners.options import REQUEST, Option, options
from runners.prompts import POST_STEPS, Encoded
from runners.text_to_image import TEXT, Defaults, TextToImage


def _section(tokens: list[int]) -> str:
    """The references' part of the prompt (QwenImage21Pipeline's): each image's placeholder, one image token a
    merged patch, before the prompt."""
    return "".join(f"{' ' if i else ''}<image{i + 1}><|vision_start|>{IMAGE_PAD * n}<|vision_end|>"
                   for i, n in enumerate(tokens))


class References(NamedTuple):
    """A call's reference images as the language model and the transformer read them."""
    merged: np.ndarray  # (tokens, width): the vision tower's tokens, image after image
    deepstack: np.ndarray  # (layers, tokens, width): its DeepStack features
    grids: list  # each image's (rows, cols) of patches
    latents: np.ndarray  # (latent tokens, channels): the references' latent tokens, image after image
    shapes: list  # each image's (rows, cols) of latent tokens


NO_REFERENCES = References(None, None, [], None, [])


def _flat(image) -> list:
    from PIL import Image

    images = [] if image is None else list(image) if isinstance(image, (list, tuple)) else [image]
    for i in images:
        if isinstance(i, (list, tuple)):
            raise ValueError("image= is one flat list of reference images for every prompt, as QwenImage21Pipeline "
                             "takes it: call once per prompt for different references")
        if not isinstance(i, (Image.Image, np.ndarray)):
            raise ValueError(f"image= takes PIL images or uint8 arrays (H, W, 3 or 4), not {type(i).__name__}")
    return [i if isinstance(i, Image.Image) else Image.fromarray(i) for i in images]


log = logging.getLogger("runners")


class QwenImage21Pipeline(TextToImage):
    family = "qwen_image21"
    layout = LatentLayout(packed_latents=True, positions=positions.qwen)  # a token a latent pixel (64 channels)
    guidance = TRUE_CFG
    defaults = {TEXT: Defaults(40, 1.0)}  # QwenImage21Pipeline's: 40 steps, no guidance
    options = options(REQUEST, guidance.options, (
        Option("sigmas", "array", "the schedule's sigmas, one a step (default: the folder's sample_sigmas, else 1 "
               "to 1 / steps)", cli=False),
        Option("image", "image", "reference images (up to 3; the CLI's --image repeated) the prompt edits or "
               "combines; the last sets the size left unset", repeat=True, group="image"),
        Option("output_resolution", "int", "with references: the side of the square whose area they (and the "
               "size left unset) are sized to, at their aspect ratio (default: the pipeline's 1024, or a tiny "
               "model's reference size)", within=lambda v: v >= 32, allowed="an integer of at least 32"),
    ))

    def generate(self, prompt, negative_prompt=None, true_cfg_scale=1.0, height=None, width=None,
                 num_inference_steps=None, sigmas=None, num_images_per_prompt=1, seed=None, latents=None,
                 output_type="pil", vae_tiling=None, image=None, output_resolution=None):
        """Generate RGBA images (call the pipeline: `pipe(prompt, ...)`). Classifier-free guidance runs only with a
        `negative_prompt` and `true_cfg_scale` above 1, as in diffusers (the model is meant to run without).
        `latents` are packed, as QwenImage21Pipeline takes them: (N, h * w, 64) for an image of 16h x 16w
        pixels. `sigmas` (or the folder's sample_sigmas) set the steps, as there. `image`: reference images (one,
        or a list of up to 3 for every prompt), each sized to about `output_resolution`² pixels at its aspect
        ratio; the size left unset is the last one's."""
        if true_cfg_scale > 1 and negative_prompt is None:  # diffusers' warnings
            log.warning("true_cfg_scale=%s does nothing without a negative_prompt: classifier-free guidance is off",
                        true_cfg_scale)
        elif true_cfg_scale <= 1 and negative_prompt is not None:
            log.warning("negative_prompt does nothing with true_cfg_scale <= 1: classifier-free guidance is off")
        if sigmas is None:
            sigmas = self.constants.get("sample_sigmas")
        images = _flat(image)
        output_resolution = output_resolution or round(self.constants["image_area"] ** 0.5)
        if images:  # the size left unset: the last reference's; sides floored to multiples of 32, as there
            calculated = calculate_dimensions(output_resolution**2, images[-1].width / images[-1].height)
            width, height = (given or size for given, size in zip((width, height), calculated))
            multiple = self.constants["vae_scale_factor"] * self.constants["latent_multiple"]
            height, width = height // multiple * multiple, width // multiple * multiple
        if latents is not None:
            latents = self._given_latents(latents, height, width, output_type, "QwenImage21Pipeline")
        references = self._references(images, output_resolution, vae_tiling) if images else NO_REFERENCES
        result = self._text_to_image(
            prompt, negative_prompt, height, width, num_inference_steps,
            true_cfg_scale if negative_prompt is not None else 1.0, num_images_per_prompt, seed, latents,
            output_type, vae_tiling, sigmas=sigmas, references=references)
        return self.layout.as_diffusers(result) if output_type == "latent" else result

    def calibration_options(self, image, index: int) -> dict:
        """The vision tower runs on references only: every other calibration call takes the calibration's picture
        as one, sized to the calibration's size."""
        from PIL import Image

        if not index % 2:
            return {}
        return {"image": Image.fromarray(np.round(image * 255).astype(np.uint8)), "output_resolution": len(image)}

    def _references(self, images: list, resolution: int, vae_tiling) -> References:
        """The references, resized as the pipeline resizes them (as RGBA), through the vision tower (composited over
        white) and the VAE (all four channels, its posterior's mode)."""
        from PIL import Image

        c = self.constants
        if len(images) > c["references"]:
            raise ValueError(f"{len(images)} reference images: this artifact takes up to {c['references']}")
        config = VisionConfig(**c["vision"])
        sized = []
        for image in images:
            rgba = image if image.mode == "RGBA" else image.convert("RGBA")
            sized.append(rgba.resize(calculate_dimensions(resolution**2, rgba.width / rgba.height),
                                     Image.Resampling.LANCZOS, reducing_gap=None))
        most = self.dims["vision_patches"][2]
        patches = []
        for rgba in sized:
            white = Image.new("RGB", rgba.size, (255, 255, 255))
            white.paste(rgba, mask=rgba.getchannel("A"))
            values, grid = pixel_patches(white, config)
            if (grid[0] * config.patch, grid[1] * config.patch) != (rgba.height, rgba.width) or len(values) > most:
                raise ValueError(f"a reference sized to {rgba.width}x{rgba.height} pixels (output_resolution="
                                 f"{resolution}) is outside what this artifact's vision tower takes (up to {most} "
                                 f"patches of {config.patch} pixels, from {config.min_pixels} to {config.max_pixels} "
                                 "pixels): pass a smaller output_resolution")
            patches.append((values, grid))
        with self._timed("text_encoders"):  # Qwen3-VL's vision tower: the prompt encoder's first part
            merged, deepstack = self._vision(patches, config)
        with self._timed("vae_encode"):
            latents = [self.vae_encode(self._vae_pixels(rgba), tiling=vae_tiling)[0] for rgba in sized]
        shapes = [latent.shape[2:] for latent in latents]
        packed = np.concatenate([self.layout.pack(latent)[0] for latent in latents])
        if len(packed) > self.dims["reference_rows"][2] - 1:
            raise ValueError(f"the references take {len(packed)} latent tokens, more than this artifact's "
                             f"{self.dims['reference_rows'][2] - 1}: pass fewer or a smaller output_resolution")
        return References(merged, deepstack, [grid for _, grid in patches], packed, shapes)

    @staticmethod
    def _vae_pixels(rgba) -> np.ndarray:
        """VaeImageProcessor's preprocessing of an RGBA image: (1, 4, H, W) in [-1, 1]."""
        return (np.asarray(rgba, dtype=np.float32) / np.float32(255) * 2 - 1).transpose(2, 0, 1)[None]

    def _vision(self, patches: list, config: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
        """The vision tower on every reference at once, each padded to the longest: its merged tokens and DeepStack
        features, image after image."""
        side = int(round((self.manifest["constants"]["vision_grid_last"] + 1) ** 0.5))
        longest = max(len(values) for values, _ in patches)
        feeds = {"pixel_values": np.zeros((len(patches), longest, patches[0][0].shape[1]), np.float32),
                 "interp_indices": np.zeros((len(patches), longest, 4), np.int64),
                 "interp_weights": np.zeros((len(patches), longest, 4), np.float32),
                 "positions": np.zeros((len(patches), longest, 2), np.int64),
                 "patch_mask": np.zeros((len(patches), longest), np.int64)}
        for i, (values, (rows, cols)) in enumerate(patches):
            taps = patch_positions(rows, cols, side, config.merge)
            n = len(values)
            for name, value in (("pixel_values", values), ("interp_indices", taps.indices),
                                ("interp_weights", taps.weights), ("positions", taps.positions),
                                ("patch_mask", np.ones(n, np.int64))):
                feeds[name][i, :n] = value
        out = self.run("image_encoder", **feeds)
        counts = [image_tokens(grid, config) for _, grid in patches]
        merged = np.concatenate([out["image_embeds"][i, :n] for i, n in enumerate(counts)])
        deepstack = np.concatenate([out["deepstack_embeds"][:, i, :n] for i, n in enumerate(counts)], axis=1)
        return merged, deepstack

    def _conditions(self, prompts, negative_prompt, per_prompt, cfg, height, width, references) -> dict:
        """Each branch's prompts padded to its longest (the image's rotary frame follows it and the references,
        `frames`); with guidance, the negative prompts' before (both padded to the longer: the padding is masked
        out); the prefix's keys and values in every block, from `transformer_prefix`."""
        branches, slots = self._encode(prompts, per_prompt, references)
        branches = [branches]
        if cfg:
            negatives, _ = self._encode(self._negatives(prompts, negative_prompt), per_prompt, references)
            branches = [negatives, *branches]
        length = max(b.embeds.shape[1] for b in branches)
        grown = sum(max(shape) for shape in references.shapes) - int(slots.sum())  # frames past the image tokens
        frames = np.concatenate([np.full(len(b.mask), b.embeds.shape[1] + grown, np.float32) for b in branches])
        embeds, mask = (np.concatenate(parts) for parts in zip(*(padded(b, length) for b in branches)))
        index, blocks, ids = self._prefix_layout(np.pad(slots, (0, length - len(slots))), references)
        text = ~np.pad(slots, (0, length - len(slots)))
        rows = np.zeros((1, 1, self.manifest["constants"]["latent_channels"]), np.float32)  # the last row: zeros
        if references.latents is not None:
            rows = np.concatenate([references.latents[None], rows], axis=1)
        prefix_mask = np.concatenate([mask[:, text], np.ones((len(mask), rows.shape[1]), np.int64)], axis=1)[:, index]
        prefix = self.run("transformer_prefix", release=True, encoder_hidden_states=np.ascontiguousarray(
            embeds[:, text]), reference_latents=np.repeat(rows, len(mask), axis=0), prefix_index=index,
            prefix_blocks=blocks, prefix_mask=prefix_mask, prefix_ids=ids, timestep=np.zeros(1, np.float32))
        return {"prefix_keys": prefix["prefix_keys"], "prefix_values": prefix["prefix_values"],
                "prefix_mask": prefix_mask, "frames": frames}

    def _prefix_layout(self, slots: np.ndarray, references: References):
        """The prefix's order, image blocks and rotary positions: walking the encoded prompt, a text token takes its
        row among the text tokens (positions n, n, n, then n + 1); the image tokens of a reference stand for its
        latent tokens (after the text rows), one block, at the frame reached (rows and columns centred), then the
        frame moves on by the reference's larger side."""
        text_rows = int((~slots).sum())
        index, blocks, ids = [], [], []
        frame, row, i, reference, start = 0, 0, 0, 0, text_rows
        while i < len(slots):
            if not slots[i]:
                index.append([row])
                blocks.append([-1])
                ids.append(np.full((1, 3), frame, np.float32))
                frame, row, i = frame + 1, row + 1, i + 1
                continue
            h, w = references.shapes[reference]
            index.append(start + np.arange(h * w))
            blocks.append(np.full(h * w, reference))
            ids.append(positions.qwen(h, w, frame))
            frame, start, i, reference = frame + max(h, w), start + h * w, i + h * w // 4, reference + 1
        return (np.concatenate(index).astype(np.int64), np.concatenate(blocks).astype(np.int64),
                np.concatenate(ids).astype(np.float32))

    def _encode(self, prompts: list[str], per_prompt: int, references: References) -> tuple[Encoded, np.ndarray]:
        """The prompts (after the references' placeholders) through the language model, with the references'
        tokens, DeepStack features and 3D positions: the states after the template's system turn, padded to the
        longest prompt, repeated for its images; and where the image tokens are in them (the same in every prompt:
        they come before it). An empty prompt (a negative one too) is read as " ", as diffusers reads it (Qwen has
        no start token)."""
        c, config = self.constants, VisionConfig(**self.constants["vision"])
        counts = [image_tokens(grid, config) for grid in references.grids]
        tok = self.tokenizers["processor"]
        # diffusers never truncates: the artifact's text range (the template's tokens and the prompt's) holds it
        most = self.dims["text_length"][2] + sum(counts)
        tokens = tok.encode([_section(counts) + (p or " ") for p in prompts], most + 1)
        if tokens.ids.shape[1] > most:
            raise ValueError(f"the prompt takes more than this artifact's {self.dims['text_length'][2]} tokens (the "
                             "pipeline's template included): shorten it")
        slot = tokens.ids == c["image_token_id"]
        width = self.manifest["constants"]["text_width"]
        image_states = np.zeros((*tokens.ids.shape, width), np.float32)
        deepstack = np.zeros((self.manifest["constants"]["deepstack_layers"], *tokens.ids.shape, width), np.float32)
        if counts:
            image_states[slot] = np.tile(references.merged, (len(prompts), 1))
            for layer, features in zip(deepstack, references.deepstack):
                layer[slot] = np.tile(features, (len(prompts), 1))
        out = self.run("text_encoder", input_ids=tokens.ids, attention_mask=tokens.mask,
                       position_ids=mrope_positions(tokens.ids, tokens.mask, c["image_token_id"], references.grids,
                                                    config),
                       image_states=image_states, deepstack_states=deepstack)
        drop = tok.drop_tokens
        encoded = POST_STEPS["repadded"](Encoded(out["hidden_states"][:, drop:], tokens.mask[:, drop:]))
        return Encoded(*(np.repeat(a, per_prompt, axis=0) for a in encoded)), slot[0, drop:drop + encoded.mask.shape[1]]

    def _predict(self, x, t, conditions: dict, release: bool, engine: str | None = None, **extra) -> dict:
        """The transformer on the image's tokens at timestep t / 1000 (as the pipeline feeds it), each image's
        rotary frame after its branch's prompts, reading the prompts' keys and values."""
        n, _, h, w = x.shape
        feeds = {k: v for k, v in conditions.items() if k != "frames"}
        img_ids = np.stack([self.layout.positions(h, w, frame) for frame in conditions["frames"]])
        out = self.run(engine or "transformer", release=release, hidden_states=self.layout.pack(x),
                       timestep=np.full(n, t, dtype=np.float32) / np.float32(1000), img_ids=img_ids, **feeds, **extra)
        return {**out, "noise_pred": self.layout.unpack(out["noise_pred"], (h, w))}
