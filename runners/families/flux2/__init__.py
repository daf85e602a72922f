"""FLUX.2 klein and dev, with the semantics of diffusers' Flux2KleinPipeline and Flux2Pipeline: each prompt through
the encoder's chat template (klein: Qwen3's, thinking off; dev: Mistral Small's, after its system message) padded
to `max_sequence_length`, the encoder's states at the layers the export read side by side, the transformer on the
latents packed as tokens (the reference images' after them: editing, runners/families/flux2/references.py), the
flow-matching sigmas from 1 to 1/steps shifted by FLUX.2's empirical mu. Guidance by variant: klein's base
checkpoints run classifier-free guidance (the empty prompt as the negative); the distilled ones (`is_distilled`)
ignore the scale, as diffusers does; dev takes it as the transformer's guidance embedding, with no second pass.
klein's KV checkpoint (Flux2KleinKVPipeline) computes its references' attention keys and values on the first step
and reads them on the others (`_predict_kv`).

The loop's latents are the pipeline's: patchified and normalised, (N, 128, H/16, W/16), which is what
`latents=` takes (diffusers draws them so); the VAE's graphs hold the batch-norm statistics and the patchify
(export/families/flux2.py). `output_type="latent"` returns diffusers' latents (denormalised, unpatchified) with
the statistics the manifest records."""
from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np

from runners.adapters.lora import register_key_spelling
from runners.families.flux2 import lora_keys
from runners.families.flux2.references import capped, reference_tokens
from runners.families.flux2.tokens import unpatchify
from runners.guidance import ClassifierFree, EmbeddedGuidance
from runners.latents import LatentLayout, positions
from runners.options import IMAGE_TASKS, MAX_SEQUENCE_LENGTH, REQUEST, Option, options
from runners.prompts import encode_prompts
from runners.conditioning.images import bilinear, to_model_input
from runners.text_to_image import INPAINT, TEXT, Defaults, TextToImage

log = logging.getLogger("runners")

REFERENCE = "reference_tokens"  # the conditions' entry that is not a feed: the references' tokens and ids
KV = "reference_kv"  # a KV checkpoint's references' keys and values, once the call's first step computed them
# Flux2KleinPipeline's and Flux2KleinInpaintPipeline's signature defaults: klein's base checkpoints run them
BASE = {TEXT: Defaults(50, 4.0), INPAINT: Defaults(50, 8.0, 0.8)}
DISTILLED = {TEXT: Defaults(4, 1.0), INPAINT: Defaults(4, 1.0, 0.8)}  # klein 4B and 9B's model cards: 4 steps
DEV = {TEXT: Defaults(50, 4.0)}  # Flux2Pipeline's: the guidance embedding's scale 4


class Flux2Pipeline(TextToImage):
    family = "flux2"
    layout = LatentLayout(positions=positions.flux2)  # a token a latent pixel, 4-axis ids; latents= unpacked
    # diffusers calls klein's transformer for the prompt, then for "" ("cond", "uncond"); the runner batches both
    guidance = ClassifierFree(contexts="uncond,cond", help="klein base: the classifier-free guidance scale (default 4; "
                              "<= 1 turns it off); dev: its guidance embedding's (default 4); klein distilled: ignored")
    embedded = EmbeddedGuidance(guidance.options[0])  # dev's: the same request option, as the transformer's input
    image_sets_size = (INPAINT,)  # Flux2KleinInpaintPipeline paints at the image's size
    mask_resize = staticmethod(bilinear)  # Flux2KleinInpaintPipeline's mask at latent size
    strength_whole_steps = False
    _mask, _strength, _noise = (o for o in IMAGE_TASKS if o.name in ("mask_image", "strength", "noise"))
    options = options(REQUEST, guidance.options, (
        replace(MAX_SEQUENCE_LENGTH, default=512, help="the text encoder's tokens of a prompt, its chat template's "
                "included: every one is read, the padding's too"),
        Option("image", "image", "reference images to edit from: one, or a list (the CLI's --image repeated); the "
               "first sets the size left unset. With mask_image: the image to repaint", repeat=True, group="image"),
        _mask, _strength, _noise,
        Option("image_reference", "image", "with mask_image: reference images for the repainted part",
               repeat=True, group="image"),
        Option("sigmas", "array", "the schedule's sigmas, one a step (default: 1 to 1 / steps)", cli=False),
        Option("text_encoder_out_layers", "array", "the text encoder's layers read: the export's only", cli=False),
    ))

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dev, self.kv = (self.constants.get("variant") == v for v in ("dev", "klein-kv"))
        self.distilled = bool(self.constants.get("distilled"))
        self.defaults = DEV if self.dev else DISTILLED if self.distilled else BASE

    def generate(self, prompt, negative_prompt=None, height=None, width=None, num_inference_steps=None, sigmas=None,
                 guidance_scale=None, num_images_per_prompt=1, seed=None, latents=None, output_type="pil",
                 max_sequence_length=512, text_encoder_out_layers=None, vae_tiling=None, image=None, mask_image=None,
                 strength=None, noise=None, image_reference=None):
        """Generate images (call the pipeline: `pipe(prompt, ...)`); with `image` (one PIL image or a list), edit
        from those references, the first setting the size left unset. Steps and guidance left None take the
        checkpoint's defaults (klein distilled: 4 steps, no guidance; klein base: 50 steps, guidance 4, the negative
        prompt "" unless `negative_prompt` is given; dev: 50 steps, guidance embedding 4). `latents` as diffusers'
        pipelines take them: (N, 128, H/16, W/16). With `mask_image` (klein), Flux2KleinInpaintPipeline's
        inpainting: `image` (one PIL image) is repainted where the mask is white, at its own size (at most
        1024 x 1024 pixels, rounded down to 16), from `strength` (default 0.8) with `noise` (N, 128, H/16, W/16)
        or drawn; the image is its first reference, and `image_reference` adds others."""
        layers = tuple(self.constants["text_encoder_out_layers"])
        if text_encoder_out_layers is not None and tuple(text_encoder_out_layers) != layers:
            raise ValueError(f"text_encoder_out_layers={tuple(text_encoder_out_layers)}: this artifact's text encoder "
                             f"reads layers {layers} only (export another choice to read others)")
        lo, _, hi = self.dims["text_length"]
        if not lo <= max_sequence_length <= hi:
            raise ValueError(f"max_sequence_length={max_sequence_length} is outside this artifact's range {lo}..{hi}")
        embedded = None
        if self.dev:
            refused = [n for n, v in (("negative_prompt", negative_prompt), ("mask_image", mask_image)) if v is not None]
            if refused:
                raise ValueError(f"{', '.join(refused)}: FLUX.2 dev (Flux2Pipeline) has no classifier-free guidance "
                                 "and no inpainting; its guidance_scale is the transformer's guidance embedding")
            embedded = self.defaults[TEXT].guidance_scale if guidance_scale is None else guidance_scale
            guidance_scale = 1.0  # no second pass
        elif self.distilled and guidance_scale is not None and guidance_scale > 1:
            log.warning("guidance_scale=%s is ignored: this FLUX.2 klein checkpoint is distilled (no guidance)",
                        guidance_scale)
            guidance_scale = 1.0
        if mask_image is not None and self.kv:
            raise ValueError("mask_image: FLUX.2 klein KV (Flux2KleinKVPipeline) has no inpainting; edit from "
                             "references with image=, or inpaint with klein 4B or 9B")
        if mask_image is not None:
            return self._inpaint(prompt, negative_prompt, height, width, num_inference_steps, sigmas, guidance_scale,
                                 num_images_per_prompt, seed, output_type, max_sequence_length, vae_tiling, image,
                                 mask_image, strength, noise, image_reference)
        given = [n for n, v in (("strength", strength), ("noise", noise), ("image_reference", image_reference))
                 if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: inpainting's (Flux2KleinInpaintPipeline); pass mask_image= too")
        reference = None
        if image is not None:
            tokens, ids, (h, w) = reference_tokens(self, image, vae_tiling)
            height, width, reference = height or h, width or w, (tokens, ids)
        result = self._text_to_image(prompt, negative_prompt, height, width, num_inference_steps, guidance_scale,
                                     num_images_per_prompt, seed, latents, output_type, vae_tiling, sigmas=sigmas,
                                     max_length=max_sequence_length, reference=reference, embedded=embedded)
        return self._as_diffusers_latents(result) if output_type == "latent" else result

    def calibration_options(self, image, index: int) -> dict:
        """KV's transformer_kv_extract runs on references only: every other calibration call edits from one."""
        from PIL import Image

        if not (self.kv and index % 2):
            return {}
        return {"image": Image.fromarray(np.round(image * 255).astype(np.uint8))}

    def _as_diffusers_latents(self, latents: np.ndarray) -> np.ndarray:
        """The loop's latents as diffusers returns them: denormalised, unpatchified (N, 32, H/8, W/8)."""
        stats = self.constants.get("latent_statistics")
        if stats is None:
            raise ValueError("output_type=\"latent\" needs the VAE's batch-norm statistics, which this artifact's "
                             "export did not find (no VAE weights): use \"np\" or \"pil\"")
        mean, std = (np.asarray(stats[k], dtype=np.float32)[None, :, None, None] for k in ("mean", "std"))
        return unpatchify(latents * std + mean)

    def _inpaint(self, prompt, negative_prompt, height, width, num_inference_steps, sigmas, guidance_scale,
                 num_images_per_prompt, seed, output_type, max_sequence_length, vae_tiling, image, mask_image,
                 strength, noise, image_reference):
        """Flux2KleinInpaintPipeline: the image (capped at 1024 x 1024 pixels) is the first reference (T = 10) and
        the starting latents' source; `image_reference` follows it (T = 20, ...)."""
        from PIL import Image

        if isinstance(image, (list, tuple)) and len(image) == 1:  # image= repeats (references): one, in a list
            image = image[0]
        if not isinstance(image, Image.Image):
            raise ValueError("image= for inpainting must be one PIL image, as Flux2KleinInpaintPipeline takes it")
        if height is not None or width is not None:
            raise ValueError("FLUX.2 klein's inpainting paints at the image's size (rounded down to 16): resize the "
                             "image instead of passing height= and width=")
        image = capped(image.convert("RGB"), self.constants["reference_area"])
        multiple = self.constants["vae_scale_factor"]
        pixels = to_model_input(image, image.height // multiple * multiple, image.width // multiple * multiple, multiple)
        latent = self.vae_encode(pixels, tiling=vae_tiling)[0]
        tokens, ids = self.layout.pack(latent), self.layout.positions(*latent.shape[2:], index=10)
        if image_reference is not None:
            more, more_ids, _ = reference_tokens(self, image_reference, vae_tiling, first=2)
            tokens, ids = np.concatenate([tokens, more], axis=1), np.concatenate([ids, more_ids])
        result = self._text_to_image(prompt, negative_prompt, None, None, num_inference_steps, guidance_scale,
                                     num_images_per_prompt, seed, None, output_type, vae_tiling, image=image,
                                     mask_image=mask_image, strength=strength, noise=noise, sigmas=sigmas,
                                     max_length=max_sequence_length, reference=(tokens, ids))
        return self._as_diffusers_latents(result) if output_type == "latent" else result

    def _image_latents(self, pixels, n_images, encoder_noise, vae_tiling):
        """The image's latents as Flux2KleinInpaintPipeline reads them: the posterior's mode, no sample."""
        z = self.vae_encode(pixels, tiling=vae_tiling)[0]
        return np.concatenate([z] * (n_images // len(z)))

    def _conditions(self, prompts, negative_prompt, per_prompt, cfg, height, width, max_length, reference,
                    embedded=None):
        embeds = self._encode(prompts, per_prompt, max_length)
        if cfg:
            negatives = self._encode(self._negatives(prompts, negative_prompt), per_prompt, max_length)
            embeds = self.guidance.batch(embeds, negatives)
        conditions = {"encoder_hidden_states": embeds, "txt_ids": positions.flux2_text(embeds.shape[1])}
        if embedded is not None:
            conditions.update(self.embedded.conditions(embedded, len(embeds)))
        if reference is not None:
            scale = self.constants["vae_scale_factor"]
            tokens, most = (height // scale) * (width // scale) + reference[0].shape[1], self.dims["image_tokens"][2]
            if tokens > most:
                raise ValueError(f"the image and its references take {tokens} tokens, more than this artifact's {most}: "
                                 "pass fewer or smaller reference images, or export for more (--image-size)")
            conditions[REFERENCE] = reference
        return conditions

    def _encode(self, prompts: list[str], per_prompt: int, max_length: int) -> np.ndarray:
        """Each prompt's states at the layers read, padding included, repeated for its images (diffusers' order)."""
        embeds = encode_prompts(self, "text_encoder", "tokenizer", prompts, max_length).embeds
        return np.repeat(embeds, per_prompt, axis=0)

    def _predict(self, x, t, conditions: dict, release: bool, engine: str | None = None, **extra) -> dict:
        """The transformer on the packed latents (the references' tokens after them), its timestep divided by
        1000 as the pipeline feeds it: its outputs, `noise_pred` the latents' tokens' unpacked."""
        n, _, h, w = x.shape
        tokens, ids = self.layout.pack(x), self.layout.positions(h, w)
        if self.kv:
            return self._predict_kv(tokens, ids, t, conditions, release, h, w)
        if REFERENCE in conditions:
            reference, reference_ids = conditions[REFERENCE]
            tokens = np.concatenate([tokens, np.repeat(reference, n, axis=0)], axis=1)
            ids = np.concatenate([ids, reference_ids])
        feeds = {k: v for k, v in conditions.items() if k != REFERENCE}
        timestep = np.full(n, t, dtype=np.float32) / np.float32(1000)
        out = self.run(engine or "transformer", release=release, hidden_states=tokens, timestep=timestep, img_ids=ids,
                       **feeds, **extra)
        return {**out, "noise_pred": self.layout.unpack(out["noise_pred"], (h, w))}

    def _predict_kv(self, tokens, ids, t, conditions: dict, release: bool, h: int, w: int) -> dict:
        """Flux2KleinKVPipeline's step (export/families/flux2_kv.py): with references, the call's first step runs
        `transformer_kv_extract` on them and the image, and the conditions keep the keys and values it returns
        for the other steps, which run `transformer` on the image's tokens alone (with none: text to image)."""
        n = len(tokens)
        feeds = {k: v for k, v in conditions.items() if k not in (REFERENCE, KV)}
        common = dict(hidden_states=tokens, timestep=np.full(n, t, dtype=np.float32) / np.float32(1000), img_ids=ids,
                      **feeds)
        if REFERENCE in conditions:
            reference, reference_ids = conditions.pop(REFERENCE)
            out = self.run("transformer_kv_extract", release=True, reference_states=np.repeat(reference, n, axis=0),
                           reference_ids=reference_ids, **common)  # once a call: its working memory freed after
            conditions[KV] = (out["reference_keys"], out["reference_values"])
        else:
            keys, values = conditions[KV] if KV in conditions else (self._no_reference_kv(n),) * 2
            out = self.run("transformer", release=release, reference_keys=keys, reference_values=values, **common)
        return {"noise_pred": self.layout.unpack(out["noise_pred"], (h, w))}

    def _no_reference_kv(self, n: int) -> np.ndarray:
        """Keys (or values) of no reference: text to image on the cached-mode graph."""
        c = self.manifest["constants"]
        return np.zeros((c["kv_layers"], n, 0, c["attention_heads"], c["attention_head_dim"]), np.float32)


register_key_spelling("flux2", lora_keys.to_diffusers_names)  # adapters in FLUX.2's original module names
