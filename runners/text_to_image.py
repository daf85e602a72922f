"""What every text-to-image family shares, with diffusers' semantics: request checks, the
starting latents, the denoising loop (with the family's guidance rule, runners/guidance.py), and the
VAE with its tiling. A family (runners/families/sd3/__init__.py, sd15.py, sdxl.py) adds only how it encodes text
into the denoiser's conditions."""
from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from runners.conditioning.images import check_mask_size, nearest, to_model_input, to_output
from runners.conditioning.inpainting import Inpainting, latent_mask
from runners.guidance import BATCHED_CFG, ClassifierFree
from runners.latents import IMAGE as IMAGE_LAYOUT, LatentLayout
from runners.pipeline import VAE_ENGINES, Pipeline
from runners.schedulers.schedule import PIPELINE_MU, PIPELINE_SIGMAS, check_steps, strength_start
from runners.static import check_static_request
from runners.tiling import tiled

OUTPUT_TYPES = ("pil", "np", "latent")


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _prompts(name: str, value) -> list[str]:
    """A prompt argument as a list of strings: one string, or a non-empty list of them."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items or not all(isinstance(p, str) for p in items):
        raise ValueError(f"{name}={value!r:.60} is not allowed: pass a string or a non-empty list of strings")
    return list(items)


def _check_shared(what: str, count: int, n_images: int) -> None:
    if n_images % count:
        raise ValueError(f"{count} {what} cannot be shared by the {n_images} images to generate (prompts x "
                         f"num_images_per_prompt): pass one, or as many as prompts")


def given_or_drawn(name: str, value, shape, rng) -> np.ndarray:
    """Noise the caller passed (checked against the shape the request needs), or drawn from `rng`."""
    if value is None:
        return rng.standard_normal(shape, dtype=np.float32)
    value = np.asarray(value, dtype=np.float32)
    if value.shape != tuple(shape):
        raise ValueError(f"{name} have shape {value.shape}; this request needs {tuple(shape)}")
    return value


def _sigmas(value) -> np.ndarray:
    sigmas = np.asarray(value, dtype=np.float64)
    if sigmas.ndim != 1 or not len(sigmas) or not np.all((sigmas > 0) & (sigmas <= 1)):
        raise ValueError(f"sigmas={value!r:.60} is not allowed: pass a non-empty list of numbers in (0, 1], one a step "
                         "(diffusers' default is from 1 to 1 / steps)")
    return sigmas


TEXT, IMAGE, INPAINT = "text to image", "image to image", "inpainting"


def task_of(image, mask_image) -> str:
    return INPAINT if mask_image is not None else IMAGE if image is not None else TEXT


class Handover(NamedTuple):
    """A second denoiser that takes over the loop's steps below a timestep (Wan 2.2 A14B's low-noise `transformer_2`,
    from `boundary_ratio` x the training timesteps), with its own guidance scale."""
    timestep: float
    engine: str
    guidance_scale: float


class Defaults(NamedTuple):
    """What a request leaves unset takes the default of the diffusers pipeline of its task."""
    num_inference_steps: int
    guidance_scale: float
    strength: float | None = None  # image to image and inpainting only


class TextToImage(Pipeline):
    defaults: dict[str, Defaults]  # {task: ...}, a family's
    # The tasks whose images set the size a request leaves unset: the image's own, rounded down (diffusers'
    # SD1.5 and SDXL Img2Img, Z-Image's Img2Img and Inpaint); in the others, the model's default size, the
    # image resized to it (SD3's, Flux's, and the SD Inpaint pipelines').
    image_sets_size: tuple[str, ...] = (IMAGE,)
    strength_whole_steps = True  # see runners.schedulers.schedule.strength_start (SD3: False)
    inpaint_decode_adds_shift = True  # see SD3Pipeline
    # How the predictions for the prompt and the negative prompt combine (runners/guidance.py): when it is
    # on, the order of the halves in the denoiser's batch, their cache contexts, and its request options.
    guidance: ClassifierFree = BATCHED_CFG
    # what the latents are, and how they meet the denoiser, the VAE, previews and `latents=` (runners/latents/)
    layout: LatentLayout = IMAGE_LAYOUT
    reads_reference_image = False  # image= is a reference to edit, not image to image's (FLUX.1 Kontext)
    # How the pixel mask comes to latent size (runners/conditioning/images.py): torch's default, nearest
    mask_resize = staticmethod(nearest)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the family's layout with this artifact's tokens: a patch of its transformer's (the export's patch_size)
        self.layout = replace(type(self).layout, patch=self.constants.get("patch_size", 1))

    def _text_to_image(self, prompt, negative_prompt, height, width, num_inference_steps, guidance_scale,
                       num_images_per_prompt, seed, latents, output_type, vae_tiling, image=None, mask_image=None,
                       strength=None, noise=None, encoder_noise=None, sigmas=None, **options):
        """The whole run: text to image; image to image when `image` is given (diffusers' Img2Img
        pipelines: the image's latents noised to the step `strength` selects, and fewer steps run);
        inpainting when `mask_image` is given too (diffusers' Inpaint pipelines: the mask's white part
        is repainted). `sigmas`: the schedule's own, unshifted, one a step, where diffusers' pipeline takes them
        (FLUX.2's). `options` go to the family's `_conditions` (text lengths, SDXL's sizes)."""
        c = self.constants
        task = task_of(image, mask_image)
        self._check_task(task, image)
        defaults = self.defaults[task]
        num_inference_steps = defaults.num_inference_steps if num_inference_steps is None else num_inference_steps
        guidance_scale = defaults.guidance_scale if guidance_scale is None else guidance_scale
        prompts = _prompts("prompt", prompt)
        check_steps(num_inference_steps, self.manifest["constants"]["num_train_timesteps"])
        sized_by_image = task in self.image_sets_size and (height is None or width is None)
        if not sized_by_image:
            # None, not 0, means "not given": 0 is refused by the size check below.
            height = c["default_image_size"] if height is None else height
            width = c["default_image_size"] if width is None else width
        n_images = len(prompts) * num_images_per_prompt
        if task == TEXT:
            given = [n for n, v in (("strength", strength), ("noise", noise), ("encoder_noise", encoder_noise))
                     if v is not None]
            if given:
                raise ValueError(f"{', '.join(given)} are image to image's: pass image= too")
        else:
            if latents is not None:
                raise ValueError(f"latents= are text to image's starting latents; {task} starts from the image: "
                                 "pass noise= (and encoder_noise=) to fix its randomness")
            strength = defaults.strength if strength is None else strength
            start = strength_start(num_inference_steps, strength, self.strength_whole_steps)
            # Counted in steps, not timesteps: PLMS's extra call would otherwise run alone (diffusers'
            # Inpaint pipelines refuse this too).
            if num_inference_steps - start < 1:
                raise ValueError(f"strength={strength} with num_inference_steps={num_inference_steps} runs no step "
                                 f"(strength x steps must be at least 1): raise either")
            pixels = to_model_input(image, height, width, multiple=c["vae_scale_factor"])
            height, width = pixels.shape[2:]
            _check_shared("images", len(pixels), n_images)
            if task == INPAINT:
                check_mask_size(image, mask_image)
                mask = to_model_input(mask_image, height, width, multiple=c["vae_scale_factor"], mask=True)
                if len(mask) not in (1, len(pixels)):
                    raise ValueError(f"{len(mask)} masks for {len(pixels)} images: pass one mask, or one per image")
        cfg = self.guidance.on(guidance_scale)
        check_static_request(self.manifest, height, width, len(prompts), num_images_per_prompt, cfg)
        self._check(height, width, n_images * (2 if cfg else 1), output_type, sized_by_image)

        guide = {o.name: options.pop(o.name) for o in self.guidance.step_options if o.name in options}
        with self._timed("text_encoders"):
            conditions = self._conditions(prompts, negative_prompt, num_images_per_prompt, cfg, height, width,
                                          **options)
        shape = self.layout.shape(self, n_images, height, width)
        rng = np.random.default_rng(seed)
        schedule = self._schedule(num_inference_steps, shape, sigmas)
        inpainting = None
        if task == TEXT:
            latents = given_or_drawn("latents", latents, shape, rng) * np.float32(schedule.init_noise_sigma)
        else:
            schedule.begin_at(start)
            encoder_noise = given_or_drawn("encoder_noise", encoder_noise, (len(pixels), *shape[1:]), rng)
            noise = given_or_drawn("noise", noise, shape, rng)
            with self._timed("vae_encode"):
                if task == IMAGE:
                    latents = schedule.noised(self._image_latents(pixels, n_images, encoder_noise, vae_tiling), noise)
                else:
                    latents, inpainting = self._inpainting(pixels, mask, n_images, strength, schedule, noise,
                                                           encoder_noise, cfg, vae_tiling)
        with self._timed("denoise"):
            latents = self._denoise(latents, schedule, guidance_scale, conditions, inpainting, guide)
        if output_type == "latent":
            return latents
        with self._timed("vae_decode"):
            z = self.layout.normalisation.to_vae(self, latents, shift=task != INPAINT or self.inpaint_decode_adds_shift)
            image = self.vae_decode(z, tiling=vae_tiling)
        return to_output(image, output_type)

    def _given_latents(self, latents, height, width, output_type, pipeline: str) -> np.ndarray:
        """`latents=` as diffusers' `pipeline` takes them (the layout's: FLUX.1's packed), checked against the
        request's size (None: the artifact's default), as the loop takes them; their count is checked with the
        request's."""
        size = self.constants["default_image_size"]
        height, width = size if height is None else height, size if width is None else width
        self._check(height, width, 1, output_type)
        return self.layout.from_diffusers(latents, self.layout.shape(self, 1, height, width), pipeline)

    def _check_task(self, task: str, image) -> None:
        """The engines and inputs a task needs: the VAE encoder for an image; an image for a mask; and a
        mask for an inpainting denoiser (one that takes the mask and the masked image as channels)."""
        unused = {name for kind in VAE_ENGINES.values() if kind != self.vae_engines for name in kind}
        missing = [n for n in self.manifest["submodules"] if n not in self.sessions and n not in unused
                   and n not in self.cache_graphs and (n != self.vae_engines[1] or task != TEXT)]
        if missing:
            raise ValueError(f"{task} needs {', '.join(missing)}, which this pipeline was loaded without "
                             "(Pipeline.load(..., submodules=...))")
        if task == INPAINT and image is None:
            raise ValueError("mask_image= needs image= too: inpainting repaints the mask's white part of an image")
        if task != INPAINT and self.inpainting_denoiser():
            raise ValueError(f"this artifact's {self.constants['denoiser']} is an inpainting one "
                             f"({self.manifest['constants']['in_channels']} input channels: the latents, the mask and "
                             "the masked image's): pass image= and mask_image=")

    def inpainting_denoiser(self) -> bool:
        """Whether the denoiser reads more channels than the latents have (the mask and the masked image's)."""
        channels = self.manifest["constants"]
        return channels["in_channels"] != channels["latent_channels"]

    def calibration_options(self, image: np.ndarray, index: int) -> dict:
        """The options calibration call `index` adds for the family: a reference to edit from, `image` ((H, W, 3)
        in [0, 1], the calibration's size), where it edits from one or needs one to run every graph (a video's
        frame count: runners/families/wan/); none here."""
        return {}

    def calibration_encode(self, output: np.ndarray) -> None:
        """Calibration: the VAE encoder on a call's output ("np"), so that its graphs are recorded too."""
        self.vae_encode(np.ascontiguousarray(output.transpose(0, 3, 1, 2)) * 2 - 1)

    def hidden_tokens(self, sides: tuple, conditions: dict) -> int:
        """A transformer's hidden stream length for latents of `sides` ((h, w), a video's (F, h, w)): the layout's
        tokens (First-Block Cache's tail residual has it); FLUX.1 Kontext's adds its reference's (in the call's
        `conditions`)."""
        return self.layout.tokens(sides)

    def control_images(self) -> int:
        """How many control images a call of this artifact takes (`control_image=`): one per ControlNet, one
        for a transformer that reads one (FLUX.1 Canny/Depth), none here."""
        return 0

    def _conditions(self, prompts, negative_prompt, per_prompt, cfg, height, width, **options) -> dict:
        """The denoiser's feeds besides the latents and the timestep, for the whole batch."""
        raise NotImplementedError

    def _image_latents(self, pixels, n_images, encoder_noise, vae_tiling):
        """diffusers' _encode_vae_image: a sample of the image's latent posterior (`encoder_noise`),
        scaled as the denoiser's latents, repeated for the images to generate."""
        z = self._posterior_latents(self.vae_encode(pixels, tiling=vae_tiling), encoder_noise)
        return np.concatenate([z] * (n_images // len(z)))  # diffusers repeats the whole batch, not each image

    def _posterior_latents(self, posterior, noise, shift: bool = True) -> np.ndarray:
        """A sample of the VAE's posterior (mean, logvar) with standard normal `noise`, shifted (unless
        `shift` is False) and scaled as the denoiser's latents."""
        if len(posterior) == 1:  # the tiny encoder's latents: diffusers takes them as they are (no sampling)
            z = posterior[0]
        else:
            mean, logvar = posterior
            z = mean + np.exp(np.float32(0.5) * logvar) * noise
        return self.layout.normalisation.from_vae(self, z, shift=shift)

    def _inpainting(self, pixels, mask, n_images, strength, schedule, noise, encoder_noise, cfg, vae_tiling):
        """diffusers' Inpaint prepare_latents and prepare_mask_latents: the starting latents (pure
        noise at strength 1, else the image's latents noised), and what each step adds. The masked
        image's posterior sample takes the same `encoder_noise` as the image's."""
        blends = not self.inpainting_denoiser()
        image_latents = self._image_latents(pixels, n_images, encoder_noise, vae_tiling) \
            if blends or strength < 1 else None
        if strength == 1:
            start = noise * np.float32(schedule.init_noise_sigma)
        else:
            start = schedule.noised(image_latents, noise)
        small_mask = latent_mask(mask, noise.shape[2:], n_images, self.mask_resize)
        if blends:
            return start, Inpainting(small_mask, noise, image_latents, channels=None)
        # diffusers encodes the masked image whatever the denoiser; only an inpainting one reads it
        masked = self._image_latents(pixels * (mask < 0.5), n_images, encoder_noise, vae_tiling)
        channels = self._inpainting_channels(small_mask, mask, masked)
        return start, Inpainting(small_mask, noise, None, np.concatenate([channels, channels]) if cfg else channels)

    def _inpainting_channels(self, small_mask, mask, masked) -> np.ndarray:
        """An inpainting denoiser's extra channels, from the latent-size mask, the pixel mask and the masked
        image's latents: SD1.5's, the mask then the latents."""
        return np.concatenate([small_mask, masked], axis=1)

    def _schedule(self, num_inference_steps: int, latent_shape, sigmas=None):
        """The scheduler's run for a request, as the artifact's pipeline sets it (manifest data,
        `pipeline.schedule`): its own sigmas (PIPELINE_SIGMAS) or the request's, and its shift by the image's
        size (PIPELINE_MU, which diffusers computes from `num_inference_steps` even where sigmas are given)."""
        rule = self.constants.get("schedule", {})
        extra = {}
        if sigmas is not None:
            extra["sigmas"] = _sigmas(sigmas)
        elif rule.get("sigmas"):
            extra["sigmas"] = PIPELINE_SIGMAS[rule["sigmas"]](num_inference_steps)
        mu = None
        if rule.get("mu"):
            mu = PIPELINE_MU[rule["mu"]](self.scheduler, self.layout.tokens(latent_shape[2:]), num_inference_steps)
        return self.scheduler.start(len(extra["sigmas"]) if "sigmas" in extra else num_inference_steps, mu, **extra)

    def _predict(self, x, t, conditions: dict, release: bool, engine: str | None = None, **extra) -> dict:
        """One denoiser call on latents `x` (N, C, h, w) at timestep `t`: the engine's outputs, its prediction
        `noise_pred` in x's layout. `engine`: another graph of the denoiser, with the same inputs and `extra`
        (First-Block Cache's and DeepCache's, runners/caches/)."""
        denoiser = self.constants["denoiser"]
        latent_input = self.manifest["submodules"][denoiser]["inputs"][0]["name"]
        return self.run(engine or denoiser, release=release, **{latent_input: x}, **conditions, **extra,
                        timestep=np.full(x.shape[0], t, dtype=np.float32))

    def _denoise(self, latents, schedule, guidance_scale, conditions, inpainting: Inpainting | None = None,
                 guide: dict | None = None, handover: Handover | None = None):
        """The loop. `guide`: the guidance rule's per-step options (Z-Image's truncation and normalization);
        `handover`: a second denoiser for the steps below its timestep, its steps counted from its first (a step
        cache keeps a state per denoiser, as diffusers' hooks on each). Guidance is on by the first scale for both,
        as diffusers' WanPipeline decides it."""
        guidance, guide = self.guidance, guide or {}
        cfg, n = guidance.on(guidance_scale), len(schedule.timesteps)
        previews = self._calls.current.previews
        alone = None  # the prompt's half of the conditions, for the steps the rule runs without guidance
        first_scale = guidance_scale
        # the steps of the first denoiser (the timesteps fall: a handover's second takes the rest)
        firsts = n if handover is None else sum(1 for t in schedule.timesteps if t >= handover.timestep)
        for i, t in enumerate(schedule.timesteps):
            second = i >= firsts
            guidance_scale = handover.guidance_scale if second else first_scale
            t_norm = (np.float32(1000) - np.float32(t)) / np.float32(1000)
            both = cfg and guidance.active(guidance_scale, t_norm, **guide)
            feeds = conditions
            if cfg and not both:
                alone = alone or {k: guidance.positive(v) if isinstance(v, np.ndarray) and len(v) == 2 * len(latents)
                                  else v for k, v in conditions.items()}
                feeds = alone
            x = schedule.scale_model_input(np.concatenate([latents, latents]) if both else latents, i)
            if inpainting is not None:
                x = inpainting.inputs(x)
            step, steps = (i - firsts, n - firsts) if second else (i, firsts)
            noise = self._evaluate(step, steps, x, t, feeds, context=guidance.contexts if both else "batch",
                                   engine=handover.engine if second else None)
            if both:
                noise = guidance.combine(noise, guidance_scale, **guide)
            if previews is not None:
                previews(i, schedule.predicted_original(noise, i, latents))
            latents = schedule.step(noise, i, latents)
            if inpainting is not None:
                latents = inpainting.blend(latents, schedule, i)
            self._progress(i + 1, n)
        return latents

    @staticmethod
    def _negatives(prompts: list[str], negative_prompt) -> list[str]:
        negative = "" if negative_prompt is None else negative_prompt
        negatives = len(prompts) * [negative] if isinstance(negative, str) else _prompts("negative_prompt", negative)
        if len(negatives) != len(prompts):
            raise ValueError(f"negative_prompt has {len(negatives)} entries for {len(prompts)} prompts")
        return negatives

    def _check(self, height, width, batch, output_type, sized_by_image=False):
        multiple = self.constants["vae_scale_factor"] * self.constants["latent_multiple"]
        for name, value in (("height", height), ("width", width)):
            lo, _, hi = self.dims[f"image_{name}"]
            if not _is_int(value) or value % multiple or not lo <= value <= hi:
                allowed = f"a multiple of {multiple} from {lo} to {hi} (the range this artifact was built for)"
                if sized_by_image:  # the image's own size, which the engines cannot take: say how to resize it
                    raise ValueError(f"the image is {height}x{width} (its size, rounded down to a multiple of "
                                     f"{self.constants['vae_scale_factor']}); its {name} must be {allowed}: pass "
                                     "height= and width= (--height/--width) to resize it")
                raise ValueError(f"{name}={value} is not allowed: use {allowed}")
        lo, _, hi = self.dims["batch"]
        if batch > hi:
            raise ValueError(f"this request runs the denoiser at batch {batch} (prompts x num_images_per_prompt, x 2 "
                             f"with guidance); the artifact allows up to {hi}: ask for fewer images per call")
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type={output_type!r}; allowed: {', '.join(OUTPUT_TYPES)}")

    def vae_decode(self, z: np.ndarray, tiling: bool | None = None, tile_size: int | None = None) -> np.ndarray:
        """Unscaled latents -> images in [-1, 1]. Latents larger than the decoder engine's range are
        decoded in overlapping tiles (`runners.tiling`); `tiling=True` forces it, `False` forbids
        it. `tile_size` is the tile's side in latent pixels (default: the engine's largest)."""
        return self._vae(self.vae_engines[0], "latent", z, self.constants["vae_scale_factor"], tiling, tile_size)[0]

    def vae_encode(self, image: np.ndarray, tiling: bool | None = None, tile_size: int | None = None):
        """Images in [-1, 1] -> (mean, log-variance) of the latent posterior (the tiny encoder: its
        latents alone), tiled past the encoder engine's range as `vae_decode` is; `tile_size` in image pixels.
        Within a call, pixels encoded before are not encoded again (FLUX.2 klein's inpainting reads its image as
        its first reference and as the starting latents)."""
        image = np.ascontiguousarray(image)
        key = (hashlib.blake2b(image.tobytes(), digest_size=16).digest(), image.shape, image.dtype.str,
               self.vae_engines, tiling, tile_size)
        encoded = self._calls.current.encoded
        if key not in encoded:
            encoded[key] = self._vae(self.vae_engines[1], "image", image, 1 / self.constants["vae_scale_factor"],
                                     tiling, tile_size)
        return [a.copy() for a in encoded[key]]  # the caller's own: it may change them

    def vae_factors(self, vae: str | None = None) -> tuple[float, float]:
        """(scaling, shift) between the denoiser's latents and the VAE's: the artifact's VAE's, or with
        "tiny" (default: the one this pipeline decodes with) its tiny autoencoder's, as diffusers reads
        them from `pipe.vae.config`."""
        if (vae or ("tiny" if self.vae_engines == VAE_ENGINES["tiny"] else "full")) == "tiny":
            tiny = self.constants["tiny_vae"]
            return tiny["scaling_factor"], tiny["shift_factor"]
        return self.constants["vae_scaling_factor"], self.constants["vae_shift_factor"]

    def _vae(self, name, input_name, x, scale, tiling, tile_size) -> list[np.ndarray]:
        if name not in self.sessions:
            raise ValueError(f"{name} is not open: the artifact has none, or the pipeline was loaded without it")
        entry = self.manifest["submodules"][name]
        outputs = [o["name"] for o in entry["outputs"]]
        # The engine's side ranges, height's and width's (a static engine's are one value each), by its input's dims.
        lo, hi = ([entry["dims"][f"{input_name}_{axis}"][i] for axis in ("height", "width")] for i in (0, 2))

        def fn(tile):  # one engine call per tile, all its outputs: copies, since the tiles are blended
            result = self.run(name, **{input_name: tile})  # after the last call, and the caller keeps
            return [result[o].copy() for o in outputs]  # the result (the backend may reuse its buffers)

        sides = x.shape[2:]
        too_big = any(side > most for side, most in zip(sides, hi))
        if tiling is False and too_big:
            raise ValueError(f"{name}: input of {sides[0]}x{sides[1]} exceeds the engine's maximum {hi[0]}x{hi[1]}; "
                             "allow tiling (tiling=None or True) or build the engines for a larger image size")
        if any(side < least for side, least in zip(sides, lo)):
            raise ValueError(f"{name}: input of {sides[0]}x{sides[1]} is below the engine's minimum {lo[0]}x{lo[1]}")
        if not (tiling or too_big):
            return fn(x)
        # Tiles are square: their side must be within both ranges.
        least, most = max(lo), min(hi)
        tile = tile_size or most
        if not least <= tile <= most:
            raise ValueError(f"{name}: tile_size={tile} is outside the engine's range {least}..{most}")
        return tiled(fn, x, tile, scale, min_side=least)
