"""FLUX.1 text to image, image to image and inpainting, with the semantics of diffusers' FluxPipeline,
FluxImg2ImgPipeline and FluxInpaintPipeline, and FLUX.1 Fill's inpainting (FluxFillPipeline: the
masked image's latents and the folded mask as more transformer channels, no blending): CLIP-L's pooled
state and T5's states as the text conditions, the latents packed in 2x2 patches with their position
ids, the flow-matching sigmas from 1 to 1/steps (shifted by the image's token count where the
scheduler says so), the guidance scale as an input of the transformer (dev) rather than a second
pass, and classifier-free guidance only as diffusers' `true_cfg_scale` with a negative prompt.

The loop works on unpacked latents (N, 16, h, w), as the other families do: packing is a
permutation, so the Euler steps, the image latents and the inpainting blend are the same there; the
transformer's input and output are packed and unpacked around each call. Not ported: `prompt_2` (T5
reads `prompt`), custom `sigmas`, IP-Adapters and FluxInpaintPipeline's `padding_mask_crop`."""
from __future__ import annotations

import numpy as np

from runners.adapters.lora import register_key_spelling
from runners.families.flux import lora_keys
from runners.conditioning.controlnet import CONTROL_NOISE, CONTROL_OPTIONS, CONTROLNETS
from runners.families.flux.controlnet import FluxControlNets
from runners.guidance import TRUE_CFG, EmbeddedGuidance
from runners.options import IMAGE_TASKS, MAX_SEQUENCE_LENGTH as T5_LENGTH, REQUEST, Option, options
from runners.families.flux.conditions import KONTEXT_MAX_AREA, control_latents, kontext_size, reference_latents
from runners.latents import LatentLayout, positions
from runners.text_to_image import IMAGE, INPAINT, TEXT, Defaults, TextToImage, task_of


# diffusers' FluxPipeline, FluxImg2ImgPipeline and FluxInpaintPipeline default to dev's settings
# whatever the checkpoint; schnell's model card runs 4 steps at 256 T5 tokens, and its transformer
# has no guidance input (the scale is unused: 0).
DEV = {TEXT: Defaults(28, 3.5), IMAGE: Defaults(28, 7.0, 0.6), INPAINT: Defaults(28, 7.0, 0.6)}
SCHNELL = {TEXT: Defaults(4, 0.0), IMAGE: Defaults(4, 0.0, 0.6), INPAINT: Defaults(4, 0.0, 0.6)}
# FLUX.1 Fill (an inpainting transformer) runs FluxFillPipeline's defaults; FLUX.1 Canny/Depth (a transformer
# that reads a control image's latents) those of FluxControlPipeline, FluxControlImg2ImgPipeline and
# FluxControlInpaintPipeline: dev's.
FILL = {INPAINT: Defaults(50, 30.0, 1.0)}
# The conditions' entries that are not engine feeds: FLUX.1 Canny/Depth's control image latents (beside the
# latents' channels) and Kontext's reference tokens with their position ids (after the image's tokens)
CONTROL_LATENTS, REFERENCE = "control_latents", "reference_tokens"
CONTROL = DEV
# FluxControlNetPipeline's and its Img2Img and Inpaint twins': 28 steps at guidance 7 (its ControlNets' model
# cards run guidance 3.5)
CONTROLNET = {TEXT: Defaults(28, 7.0), IMAGE: Defaults(28, 7.0, 0.6), INPAINT: Defaults(28, 7.0, 0.6)}
KONTEXT = {TEXT: Defaults(28, 3.5)}  # FluxKontextPipeline's: image= is its reference, not image to image's
MAX_SEQUENCE_LENGTH = {"dev": 512, "schnell": 256}


class FluxPipeline(FluxControlNets, TextToImage):
    family = "flux"
    # ComfyUI's latent_rgb_factors and bias for FLUX.1's latents (runners/preview.py)
    layout = LatentLayout(packed_latents=True, positions=positions.flux1, latent_rgb={16: (
        [[-0.0346, 0.0244, 0.0681], [0.0034, 0.0210, 0.0687], [0.0275, -0.0668, -0.0433],
         [-0.0174, 0.0160, 0.0617], [0.0859, 0.0721, 0.0329], [0.0004, 0.0383, 0.0115], [0.0405, 0.0861, 0.0915],
         [-0.0236, -0.0185, -0.0259], [-0.0245, 0.0250, 0.1180], [0.1008, 0.0755, -0.0421],
         [-0.0515, 0.0201, 0.0011], [0.0428, -0.0012, -0.0036], [0.0817, 0.0765, 0.0749],
         [-0.1264, -0.0522, -0.1103], [-0.0280, -0.0881, -0.0499], [-0.1262, -0.0982, -0.0778]],
        [-0.0329, -0.0718, -0.0851])})
    image_sets_size = ()  # every Flux pipeline renders at the requested (or the default) size
    strength_whole_steps = False
    guidance = TRUE_CFG  # FluxPipeline's: true_cfg_scale with a negative prompt (runners/guidance.py)
    embedded = EmbeddedGuidance(Option("guidance_scale", "float", "FLUX.1 dev's guidance embedding (default: "
                                       "diffusers', 3.5, and with an image 7; schnell has none)", flag="--guidance"))
    options = options(REQUEST, (embedded.option,), guidance.options, (T5_LENGTH,), IMAGE_TASKS, CONTROL_OPTIONS, (
        CONTROL_NOISE,
        Option("control_mode", "int", "a ControlNet-Union's control mode (the kind of control image: its model card "
               "lists them): one for every ControlNet, or one per ControlNet", repeat=True, group="controlnet"),
        Option("max_area", "int", "FLUX.1 Kontext: the output's area in pixels (default 1024**2)"),
        Option("auto_resize", "bool", "FLUX.1 Kontext: resize the reference to a trained resolution", default=True)))

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        inputs = [t["name"] for t in self.manifest["submodules"]["transformer"]["inputs"]]
        # A guidance-distilled transformer (FLUX.1-dev) takes the scale as an input; a timestep-distilled
        # one (schnell) has none.
        self.variant = "dev" if self.embedded.feed in inputs else "schnell"
        self.reads_reference_image = bool(self.constants.get("reference_image"))  # FLUX.1 Kontext's transformer
        self.defaults = (CONTROL if self.reads_control_image else FILL if self.inpainting_denoiser()
                         else KONTEXT if self.reads_reference_image else DEV if self.variant == "dev" else SCHNELL)

    @property
    def reads_control_image(self) -> bool:
        """Whether the transformer is FLUX.1 Canny/Depth's, which reads a control image's latents beside the
        latents (twice their channels; Fill's reads the masked image's latents and the folded mask)."""
        c = self.manifest["constants"]
        return c["in_channels"] == 2 * c["latent_channels"]

    def inpainting_denoiser(self) -> bool:
        return super().inpainting_denoiser() and not self.reads_control_image

    def control_images(self) -> int:
        return len(self.controlnets()) or int(self.reads_control_image)

    def run(self, submodule: str, release: bool = True, **feeds):
        """One engine call, whose outputs must be finite: an artifact past its numeric range (fp16 beyond
        the magnitudes it was calibrated on) is an error naming the engine, never a black image."""
        out = super().run(submodule, release=release, **feeds)
        bad = [name for name, value in out.items() if not np.isfinite(value).all()]
        if bad:
            raise FloatingPointError(
                f"{submodule} returned non-finite values in {', '.join(bad)} ({self.manifest['precision']} "
                "artifact): run an fp32 or OpenVINO bf16 artifact, or rebuild fp16 calibrated on requests like "
                "this one")
        return out

    def generate(self, prompt, negative_prompt=None, height=None, width=None, num_inference_steps=None,
                 guidance_scale=None, true_cfg_scale=1.0, num_images_per_prompt=1, seed=None, latents=None,
                 output_type="pil", max_sequence_length=None, vae_tiling=None, image=None, mask_image=None,
                 strength=None, noise=None, encoder_noise=None, control_image=None, control_noise=None, max_area=None,
                 auto_resize=True, controlnet_conditioning_scale=None, control_guidance_start=0.0,
                 control_guidance_end=1.0, control_mode=None):
        """Generate images (call the pipeline: `pipe(prompt, ...)`, which adds `profile=DIR`); from an
        `image` too (image to image, with `strength`), and a `mask_image` (inpainting). Unset steps,
        guidance, strength and `max_sequence_length` take the variant's defaults (`defaults`; dev 512
        T5 tokens, schnell 256). `guidance_scale` is dev's guidance embedding (schnell has none);
        classifier-free guidance runs only with a `negative_prompt` and `true_cfg_scale` > 1, as in
        diffusers. `latents` are packed, as FluxPipeline takes them: (N, h/2 * w/2, 64) for latent
        sides h, w; `noise` and `encoder_noise` (the image tasks') are not: (N, 16, h, w). `seed`
        seeds numpy's generator, not torch's noise: pass the draws for exact comparison.
        `control_image` (one, or one per prompt) is FLUX.1 Canny/Depth's (FluxControlPipeline, and with
        `image=` FluxControlImg2ImgPipeline, with `mask_image=` too FluxControlInpaintPipeline), which that
        transformer needs: its VAE posterior sample takes `control_noise` (N, 16, h, w). On an artifact exported
        with Flux ControlNets, `control_image` (one per ControlNet) and the other ControlNet settings are those
        of diffusers' FluxControlNetPipeline and its Img2Img and Inpaint twins (runners/families/flux/controlnet.py),
        whose defaults are 28 steps and guidance 7; `control_noise` is then one per ControlNet, a list for
        several, and `control_mode` is a ControlNet-Union's (an int, or a list: one per ControlNet, None for
        those of one condition). On FLUX.1 Kontext
        (FluxKontextPipeline) `image` is the reference to edit, resized to the trained resolution of its
        aspect ratio unless `auto_resize=False`, and the output size is the requested one's aspect ratio
        at `max_area` pixels (default 1024**2)."""
        reference = None
        if self.reads_reference_image:
            height, width, reference = self._kontext_request(height, width, image, mask_image, strength, noise,
                                                             max_area, auto_resize, vae_tiling)
            image = None
        elif max_area is not None or auto_resize is not True:
            raise ValueError("max_area= and auto_resize= are FLUX.1 Kontext's (flux-kontext); this artifact is not")
        task = task_of(image, mask_image)
        if control_mode is not None and not self.controlnets():
            raise ValueError("control_mode= is a ControlNet-Union's setting: this artifact has no ControlNet")
        controlnets = self._control_request(task, control_image, controlnet_conditioning_scale,
                                            control_guidance_start, control_guidance_end, False, noise=control_noise,
                                            seed=seed, vae_tiling=vae_tiling, modes=control_mode) \
            if self.controlnets() else None
        if controlnets is not None:
            control_image = control_noise = None  # the ControlNets'
        elif self.reads_control_image != (control_image is not None):
            raise ValueError("this artifact's transformer is FLUX.1 Canny/Depth's: pass control_image= (an edge or "
                             "depth map)" if self.reads_control_image else "control_image= is for a FLUX.1 Canny/Depth "
                             "artifact (flux-canny, flux-depth); this one's transformer reads none")
        if control_noise is not None and control_image is None:
            raise ValueError("control_noise= is the control image's VAE sample: pass control_image= too")
        if task not in self.defaults:  # FLUX.1 Fill's transformer only inpaints
            self._check_task(task, image)
        defaults = CONTROLNET[task] if controlnets is not None else self.defaults[task]
        num_inference_steps = defaults.num_inference_steps if num_inference_steps is None else num_inference_steps
        guidance_scale = defaults.guidance_scale if guidance_scale is None else guidance_scale
        if max_sequence_length is None:
            max_sequence_length = min(MAX_SEQUENCE_LENGTH[self.variant], self.dims["text_length"][2])
        lo, _, hi = self.dims["text_length"]
        if isinstance(max_sequence_length, bool) or not isinstance(max_sequence_length, (int, np.integer)) or \
                not lo <= max_sequence_length <= hi:
            raise ValueError(f"max_sequence_length={max_sequence_length!r} is not allowed: use an integer from {lo} "
                             f"to {hi} (this artifact's T5 range)")
        if latents is not None:
            latents = self._given_latents(latents, height, width, output_type, "FluxPipeline")
        control = dict(control_image=control_image, noise=control_noise, seed=seed, vae_tiling=vae_tiling) \
            if control_image is not None else None
        result = self._text_to_image(prompt, negative_prompt, height, width, num_inference_steps,
                                     true_cfg_scale if negative_prompt is not None else 1.0,
                                     num_images_per_prompt, seed, latents, output_type, vae_tiling,
                                     image=image, mask_image=mask_image, strength=strength, noise=noise,
                                     encoder_noise=encoder_noise, text_length=max_sequence_length,
                                     guidance=guidance_scale, control=control, reference=reference,
                                     controlnets=controlnets)
        return self.layout.as_diffusers(result) if output_type == "latent" else result

    def calibration_options(self, image, index: int) -> dict:
        """Kontext's transformer runs on a reference only: one at every call, at the calibration's size."""
        side = len(image)
        return dict(image=image, max_area=side * side, auto_resize=False) if self.reads_reference_image else {}

    def _kontext_request(self, height, width, image, mask_image, strength, noise, max_area, auto_resize, vae_tiling):
        """FLUX.1 Kontext's output size and reference image (None without one)."""
        given = [n for n, v in (("mask_image", mask_image), ("strength", strength), ("noise", noise)) if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: FLUX.1 Kontext edits the image= it is given as a reference, "
                             "without a mask or strength")
        size = self.constants["default_image_size"]
        height, width = kontext_size(size if height is None else height, size if width is None else width,
                                     KONTEXT_MAX_AREA if max_area is None else max_area,
                                     self.constants["vae_scale_factor"] * self.layout.patch)
        reference = dict(image=image, auto_resize=auto_resize, vae_tiling=vae_tiling) if image is not None else None
        return height, width, reference

    def _conditions(self, prompts, negative_prompt, per_prompt, cfg, height, width, text_length, guidance, control,
                    reference, controlnets):
        n_images = len(prompts) * per_prompt
        added = self._control_conditions(controlnets, height, width, n_images, per_prompt, cfg)
        if control is not None:
            added[CONTROL_LATENTS] = control_latents(self, height=height, width=width, n_images=n_images, **control)
        if reference is not None:
            added[REFERENCE] = self._reference_tokens(reference, height, width, n_images)
        embeds, pooled = self._encode(prompts, per_prompt, text_length)
        if cfg:
            neg_embeds, neg_pooled = self._encode(self._negatives(prompts, negative_prompt), per_prompt, text_length)
            embeds, pooled = self.guidance.batch(embeds, neg_embeds), self.guidance.batch(pooled, neg_pooled)
        conditions = {"encoder_hidden_states": embeds, "pooled_projections": pooled,
                      "txt_ids": np.zeros((text_length, 3), dtype=np.float32)}
        if self.variant == "dev":
            conditions.update(self.embedded.conditions(guidance, len(embeds)))
        return {**conditions, **added}

    def _encode(self, prompts: list[str], per_prompt: int, text_length: int):
        """diffusers' encode_prompt: T5's last states, and CLIP-L's pooled state."""
        clip_ids = self.tokenizers["tokenizer"](prompts, self.constants["clip_length"])
        pooled = self.run("text_encoder", input_ids=clip_ids)["pooler_output"]
        embeds = self.run("text_encoder_2", input_ids=self.tokenizers["tokenizer_2"](prompts, text_length))
        return np.repeat(embeds["last_hidden_state"], per_prompt, axis=0), np.repeat(pooled, per_prompt, axis=0)

    def _reference_tokens(self, reference: dict, height: int, width: int, n_images: int):
        """The reference's packed latents and their position ids (1, row, column), checked against the engine's
        image token range together with the image's."""
        z = reference_latents(self, n_images=n_images, **reference)
        scale = self.constants["vae_scale_factor"]
        tokens = self.layout.tokens((height // scale, width // scale)) + self.layout.tokens(z.shape[2:])
        most = self.dims["image_tokens"][2]
        if tokens > most:
            raise ValueError(f"the image and its reference image take {tokens} image tokens, more than this artifact's "
                             f"{most}: lower max_area=, pass auto_resize=False with a smaller image=, or export with a "
                             "larger --image-size")
        p = self.layout.patch
        return self.layout.pack(z), self.layout.positions(z.shape[2] // p, z.shape[3] // p, index=1)

    def _inpainting_channels(self, small_mask, mask, masked) -> np.ndarray:
        """FLUX.1 Fill's (FluxFillPipeline.prepare_mask_latents): the masked image's latents, then the pixel
        mask folded into its vae_scale_factor x vae_scale_factor patches (64 channels at latent size)."""
        n, _, height, width = mask.shape
        s = self.constants["vae_scale_factor"]
        folded = mask[:, 0].reshape(n, height // s, s, width // s, s).transpose(0, 2, 4, 1, 3)
        folded = folded.reshape(n, s * s, height // s, width // s)
        return np.concatenate([masked, np.concatenate([folded] * (len(masked) // n))], axis=1)

    def _predict(self, x, t, conditions: dict, release: bool, engine: str | None = None, **extra) -> dict:
        """The transformer (or `engine`, another graph of it, with `extra` inputs) on the packed latents, its
        timestep divided by 1000 (as the pipeline feeds it): its outputs, `noise_pred` unpacked."""
        n, _, h, w = x.shape
        feeds = {k: v for k, v in conditions.items() if k not in (CONTROL_LATENTS, REFERENCE, CONTROLNETS)}
        control = conditions.get(CONTROL_LATENTS)
        if control is not None:  # the same control for guidance's halves
            x = np.concatenate([x, np.concatenate([control] * (n // len(control)))], axis=1)
        p = self.layout.patch
        tokens, ids = self.layout.pack(x), self.layout.positions(h // p, w // p)
        if REFERENCE in conditions:  # Kontext's reference tokens after the image's, for guidance's halves too
            reference, reference_ids = conditions[REFERENCE]
            tokens = np.concatenate([tokens, np.concatenate([reference] * (n // len(reference)))], axis=1)
            ids = np.concatenate([ids, reference_ids])
        timestep = np.full(n, t, dtype=np.float32) / np.float32(1000)
        batched = {k: v for k, v in feeds.items() if k != "txt_ids"}
        residuals = self._control_residuals(engine, tokens, timestep, batched, release, conditions.get(CONTROLNETS),
                                            img_ids=ids, txt_ids=feeds["txt_ids"])
        out = self.run(engine or "transformer", release=release, hidden_states=tokens, timestep=timestep,
                       img_ids=ids, **feeds, **residuals, **extra)
        return {**out, "noise_pred": self.layout.unpack(out["noise_pred"], (h, w))}

    def hidden_tokens(self, sides: tuple, conditions: dict) -> int:
        reference = conditions.get(REFERENCE)
        return super().hidden_tokens(sides, conditions) + (0 if reference is None else reference[0].shape[1])


register_key_spelling("flux", lora_keys.to_diffusers_names)  # adapters in FLUX.1's original module names
