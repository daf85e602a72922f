"""ControlNet in the runners: what every family's ControlNets share (the request, the guidance window,
summing several ControlNets, zeros without control), and the U-Net families' own, with the semantics of
diffusers' StableDiffusion(XL)ControlNet pipelines and their Img2Img and Inpaint twins. SD3's and Flux's
differ in how a control image becomes the engine's input and which residual feeds which transformer
block (runners/families/sd3/controlnet.py, runners/families/flux/controlnet.py).

Each ControlNet engine (`controlnet`, `controlnet_1`, ...) reads the latents, the timestep, the text
conditions and its control image, and returns the UNet's residuals already scaled (one factor per
residual: `controlnet_conditioning_scale`, times the 0.1-to-1 ramp of guess mode); the residuals of
several ControlNets add up. The UNet takes them as inputs and gets zeros when none runs: a ControlNet
outside its guidance window (`control_guidance_start`/`_end`, fractions of the steps) or at scale 0
is not run at all (diffusers runs it at scale 0, which gives the same zeros).

Guess mode under guidance runs the ControlNets on the conditional half only, and the unconditional
half gets zero residuals. Control images are resized to the request's size (Lanczos for PIL images,
nearest for numpy ones), in [0, 1], repeated for the images to generate and doubled under guidance.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runners.conditioning.images import nearest, to_model_input
from runners.options import Option
from runners.text_to_image import IMAGE, INPAINT, TEXT, given_or_drawn, task_of

# The ControlNet options every family's ControlNets read (a family adds its own: GUESS_MODE, CONTROL_MODE)
CONTROL_OPTIONS = (
    Option("control_image", "image", "the control image of each ControlNet of the artifact (a list: one per "
           "ControlNet, in the order controlnet, controlnet_1, ...); its size is the image's unless height/width",
           repeat=True, group="controlnet"),
    Option("controlnet_conditioning_scale", "float", "one for every ControlNet, or one per ControlNet (default: "
           "diffusers' for the task)", repeat=True, flag="--control-scale", group="controlnet"),
    Option("control_guidance_start", "float", "the ControlNets act from this fraction of the steps", default=0.0,
           flag="--control-start", group="controlnet"),
    Option("control_guidance_end", "float", "... up to this fraction of the steps", default=1.0,
           flag="--control-end", group="controlnet"),
)
CONTROL_NOISE = Option("control_noise", "array", "the control images' VAE posterior samples", cli=False,
                       group="controlnet")
# The conditions' entry of a controlled call (`_control_conditions`): its ControlRun, which `_predict` takes out
CONTROLNETS = "controlnets"
GUESS_MODE = Option("guess_mode", "bool", "ControlNet guess mode: the ControlNets see the conditional half of "
                    "guidance only", default=False, group="controlnet")


def residual_inputs(entry: dict) -> list[dict]:
    """A denoiser's ControlNet residual inputs, from its manifest entry: the UNet's down_residual_i and
    mid_residual, a transformer's block_residual_i (SD3), double_residual_i and single_residual_j (Flux)."""
    return [t for t in entry["inputs"] if t["name"].endswith("_residual") or "_residual_" in t["name"]]


def controlnets(manifest: dict) -> list[str]:
    """An artifact's ControlNet engines in order: controlnet, controlnet_1, ..."""
    names = [n for n in manifest["submodules"] if n == "controlnet" or n.startswith("controlnet_")]
    return sorted(names, key=lambda n: 0 if n == "controlnet" else int(n.rsplit("_", 1)[1]))


def _per_net(name: str, value, count: int) -> list[float]:
    """A number for every ControlNet, or one per ControlNet."""
    values = list(value) if isinstance(value, (list, tuple)) else [value] * count
    if len(values) != count or any(isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or
                                   not np.isfinite(v) for v in values):
        raise ValueError(f"{name}={value!r} is not allowed: pass a number, or a list of {count} numbers "
                         f"(one per ControlNet of this artifact)")
    return [float(v) for v in values]


def _check_image(value) -> None:
    from PIL import Image

    items = value if isinstance(value, (list, tuple)) else [value]
    if not items or not all(isinstance(i, (Image.Image, np.ndarray)) for i in items):
        raise ValueError(f"control_image must be a PIL image, a numpy array (H, W, 3) in [0, 1], or a list of them "
                         f"(one per prompt), for each ControlNet; got {type(value).__name__}")


@dataclass
class ControlRequest:
    """A call's ControlNet arguments, checked against the artifact's ControlNets."""

    images: list  # one image argument (an image, or a list: a batch) per ControlNet
    scales: list[float]
    starts: list[float]
    ends: list[float]
    guess_mode: bool
    # A family that encodes control images with the VAE (SD3) draws their posterior samples: given ones,
    # or from the call's seed
    noise: np.ndarray | None = None
    seed: int | None = None
    vae_tiling: bool | None = None
    mask: object = None  # the mask of inpainting ControlNets (SD3's, Z-Image's): white is repainted
    repainted: object = None  # the image they repaint where it is not the control image (Z-Image's `image=`)
    modes: list | None = None  # per ControlNet, a ControlNet-Union's control mode (Flux's), else None

    @classmethod
    def of(cls, engines: list[str], control_image, scale=1.0, start=0.0, end=1.0, guess_mode=False, **draws):
        if not engines:
            raise ValueError("control_image= needs a ControlNet: this artifact has none; export the model with "
                             "`python -m export MODEL --controlnet FOLDER_OR_HUB_ID` and build it again")
        count = len(engines)
        images = list(control_image) if count > 1 and isinstance(control_image, (list, tuple)) else [control_image]
        for image in images:
            _check_image(image)
        if len(images) != count:
            raise ValueError(f"control_image: this artifact has {count} ControlNets ({', '.join(engines)}); pass a "
                             f"list of {count} control images, one per ControlNet, in that order")
        scales = _per_net("controlnet_conditioning_scale", scale, count)
        starts = _per_net("control_guidance_start", start, count)
        ends = _per_net("control_guidance_end", end, count)
        for s, e in zip(starts, ends):
            if not 0 <= s < e <= 1:
                raise ValueError(f"control_guidance_start={s} and control_guidance_end={e}: use 0 <= start < end <= 1 "
                                 "(fractions of the denoising steps)")
        if not isinstance(guess_mode, bool):
            raise ValueError(f"guess_mode={guess_mode!r} is not allowed: use True or False")
        return cls(images, scales, starts, ends, guess_mode, **draws)

    def size(self, multiple: int) -> tuple[int, int]:
        """The first control image's size, rounded down to `multiple`: a request's size when it gives none."""
        first = to_model_input(self.images[0], None, None, multiple)
        return first.shape[2], first.shape[3]


@dataclass
class ControlRun:
    """What a call's denoising loop needs: the prepared control images and the scale of each step."""

    engines: list[str]
    images: list[np.ndarray]  # per ControlNet: its controlnet_cond, at the batch it runs at
    request: ControlRequest
    half: bool  # under guidance the ControlNets see the conditional half only
    # and the unconditional half gets zero residuals (guess mode), else the same ones (Flux's true CFG)
    zero_uncond: bool = True
    step: tuple[int, int] = (0, 1)  # (step, number of steps) of the evaluation under way

    def scale(self, k: int) -> float:
        """ControlNet k's scale at the current step: 0 outside its window (diffusers' controlnet_keep)."""
        i, n = self.step
        outside = i / n < self.request.starts[k] or (i + 1) / n > self.request.ends[k]
        return 0.0 if outside else self.request.scales[k]

    def factors(self, scale: float, residuals: int) -> np.ndarray:
        """One factor per residual: the scale, on guess mode's ramp from 0.1 (first) to 1 (mid block)."""
        ramp = np.logspace(-1, 0, residuals) if self.request.guess_mode else np.ones(residuals)
        return (ramp * scale).astype(np.float32)


def canny_edges(image, low: float = 100, high: float = 200):
    """A canny edge map of a PIL image (white edges on black, RGB), as diffusers' ControlNet examples make
    them: OpenCV's Canny on the image's grey levels, hysteresis thresholds `low` and `high`."""
    try:
        import cv2
    except ImportError:
        raise ValueError("canny edge maps need OpenCV: pip install 'diffusion-aot[canny]' "
                         "(opencv-python-headless)") from None
    from PIL import Image

    edges = cv2.Canny(np.asarray(image.convert("L")), low, high)
    return Image.fromarray(np.repeat(edges[..., None], 3, axis=-1))


class ControlNets:
    """The ControlNet side of a family's pipeline: `_predict` feeds the denoiser the residuals. The hooks
    below are the U-Nets'; SD3's are in runners/families/sd3/controlnet.py."""

    # {task: Defaults} of diffusers' ControlNet pipelines where they differ from the family's others
    control_defaults: dict = {}
    # {task: controlnet_conditioning_scale} by default: diffusers' ControlNet pipelines' (SD1.5's); the
    # tasks named are those diffusers has ControlNet pipelines for
    control_scales = {TEXT: 1.0, IMAGE: 0.8, INPAINT: 0.5}
    control_sets_size = True  # a request without a size takes the control image's
    # Under guidance the ControlNets run once, on the prompt's half, and both halves take their residuals
    # (FluxControlNetPipeline's true CFG)
    guided_halves_share_residuals = False
    # Whether a step cache may skip steps of a controlled call: not where the residuals are added between
    # a transformer's blocks, which a cached step skips (SD3, Flux); DeepCache's shallow UNet takes its own
    runs_with_step_caches = True
    # diffusers' pipeline of the family's inpainting ControlNets (`control_masks`): they read the control image with
    # its masked part (diffusers' `control_mask`) and start from noise (SD3's, Qwen-Image's)
    masked_control_pipeline = None

    def _controlled_text_to_image(self, prompt, negative_prompt, height, width, num_inference_steps, guidance_scale,
                                  num_images_per_prompt, seed, latents, output_type, vae_tiling, image=None,
                                  mask_image=None, strength=None, control_image=None,
                                  controlnet_conditioning_scale=None, control_guidance_start=0.0,
                                  control_guidance_end=1.0, guess_mode=False, control_noise=None, **kwargs):
        """`_text_to_image` with ControlNets: the size a request leaves None is the control image's (where
        `control_sets_size`), and the steps, guidance, strength and conditioning scale left None are
        diffusers' ControlNet pipeline's for the task."""
        image, mask_image, inpainting = self._control_inpainting(control_image, image, mask_image)
        task = task_of(image, mask_image)
        control = self._control_request(task, control_image, controlnet_conditioning_scale, control_guidance_start,
                                        control_guidance_end, guess_mode, noise=control_noise, seed=seed,
                                        vae_tiling=vae_tiling, **inpainting)
        height, width = self._control_size(control, height, width, image)
        defaults = self.control_defaults.get(task) if control is not None else None
        if defaults is not None:
            num_inference_steps = defaults.num_inference_steps if num_inference_steps is None else num_inference_steps
            guidance_scale = defaults.guidance_scale if guidance_scale is None else guidance_scale
            strength = defaults.strength if strength is None else strength
        return self._text_to_image(prompt, negative_prompt, height, width, num_inference_steps, guidance_scale,
                                   num_images_per_prompt, seed, latents, output_type, vae_tiling, image=image,
                                   mask_image=mask_image, strength=strength, control=control, **kwargs)

    def _control_inpainting(self, control_image, image, mask_image) -> tuple:
        """(the request's image and mask_image, the ControlRequest fields of inpainting ControlNets: their `mask`
        and the image they repaint): the U-Nets' inpainting ControlNet pipelines mask the image, which their
        ControlNets do not see; ControlNets that read a mask (`control_masks`) take `mask_image` as theirs."""
        if not self.manifest["constants"].get("control_masks") or control_image is None:
            return image, mask_image, {}
        if mask_image is None or image is not None:
            raise ValueError(f"this artifact's ControlNets inpaint ({self.masked_control_pipeline}'s): pass the image "
                             "to repaint as control_image= and its mask as mask_image= (white: repainted), without "
                             "image=")
        return None, None, {"mask": mask_image}

    def _masked_control_latents(self, name, given, request, height, width, n_images, per_prompt) -> np.ndarray:
        """An inpainting ControlNet's condition as diffusers' pipelines make it: the control image with its masked
        part (`request.mask` white) set to -1, a sample of its VAE posterior (`_control_noise`) scaled as the
        latents, and the kept part's mask at latent size beside them: (N, latent channels + 1, h, w)."""
        scale = self.constants["vae_scale_factor"]
        pixels = self._control_batch(name, to_model_input(given, height, width, scale), n_images, per_prompt, False)
        mask = self._control_batch(name, to_model_input(request.mask, height, width, scale, mask=True), n_images,
                                   per_prompt, False)
        posterior = self.vae_encode(np.where(mask > 0.5, np.float32(-1), pixels), tiling=request.vae_tiling)
        latents = self._posterior_latents(posterior, self._control_noise(name, request, posterior[0].shape))
        return np.concatenate([latents, 1 - nearest(mask, *latents.shape[2:])], axis=1)

    def _control_noise(self, name, request, shape) -> np.ndarray:
        """ControlNet `name`'s VAE posterior sample noise: given (`control_noise`, a list of them for several
        ControlNets), or drawn from a stream of the call's seed that the latents' does not use."""
        k = self.controlnets().index(name)
        noise = request.noise[k] if isinstance(request.noise, (list, tuple)) else request.noise
        return given_or_drawn("control_noise", noise, shape,
                              np.random.default_rng(None if request.seed is None else (request.seed, 2 + k)))

    def controlnets(self) -> list[str]:
        return controlnets(self.manifest)

    def control_images(self) -> int:
        return len(self.controlnets())

    def _residual_inputs(self) -> list[dict]:
        """The denoiser's residual inputs; none for a UNet exported without them."""
        return residual_inputs(self.manifest["submodules"][self.constants["denoiser"]])

    def _control_request(self, task, control_image, scale, start, end, guess_mode, **draws) -> ControlRequest | None:
        """The call's ControlNet arguments, checked; None without a control image. `draws`: see ControlRequest."""
        if control_image is not None and task not in self.control_scales:
            raise ValueError(f"control_image= with {task}: diffusers has no such {self.family} ControlNet pipeline; "
                             f"{self.family} ControlNets run for {', '.join(self.control_scales)}")
        if draws.get("noise") is not None and control_image is None:
            raise ValueError("control_noise= is the control images' VAE sample: pass control_image= too")
        if draws.get("modes") is not None and control_image is None:
            raise ValueError("control_mode= is the kind of each control image (ControlNet-Union): pass control_image= "
                             "too")
        if control_image is None:
            given = [n for n, v, unset in (("controlnet_conditioning_scale", scale, None),
                                           ("control_guidance_start", start, 0.0),
                                           ("control_guidance_end", end, 1.0), ("guess_mode", guess_mode, False))
                     if v != unset]
            if given:
                raise ValueError(f"{', '.join(given)} are ControlNet settings: pass control_image= too")
            return None
        if not self._residual_inputs():
            raise ValueError(f"this artifact's {self.constants['denoiser']} takes no ControlNet residuals (its layout "
                             "is not its family's real one): control_image= cannot be used")
        scale = self.control_scales[task] if scale is None else scale
        draws["modes"] = self._control_modes(draws.get("modes"))
        return ControlRequest.of(self.controlnets(), control_image, scale, start, end, guess_mode, **draws)

    def _control_modes(self, given) -> list | None:
        """The control mode of each ControlNet-Union of the artifact (diffusers' `control_mode`: an int for all,
        or a list with one per ControlNet, None for those of one condition), checked; None without any."""
        names = self.controlnets()
        counts = dict(zip(names, self.manifest["constants"].get("control_modes") or [0] * len(names)))
        unions = [name for name, count in counts.items() if count]
        if given is None:
            if unions:
                raise ValueError(f"{', '.join(unions)}: ControlNet-Union, which needs control_mode= (the kind of its "
                                 f"control image, 0 to {counts[unions[0]] - 1}: its model card lists them)")
            return None
        modes = list(given) if isinstance(given, (list, tuple)) else [given] * len(counts)
        if len(modes) != len(counts):
            raise ValueError(f"control_mode={given!r}: pass one, or a list of {len(counts)} (one per ControlNet)")
        for (name, count), mode in zip(counts.items(), modes):
            if not count and mode is not None:
                raise ValueError(f"control_mode: {name} is not a ControlNet-Union (it has one condition): give it "
                                 "None in a list, or give no control_mode=")
            if count and (isinstance(mode, bool) or not isinstance(mode, (int, np.integer)) or not 0 <= mode < count):
                raise ValueError(f"control_mode={mode!r} for {name}: use an integer from 0 to {count - 1}")
        return modes

    def _control_size(self, request: ControlRequest | None, height, width, image) -> tuple:
        """diffusers' U-Net ControlNet pipelines take the control image's size when the request gives none."""
        if (request is None or not self.control_sets_size or image is not None or height is not None
                or width is not None):
            return height, width
        return request.size(self.constants["vae_scale_factor"])

    def _control_conditions(self, request: ControlRequest | None, height, width, n_images, per_prompt, cfg) -> dict:
        """The call's ControlNets as an entry of its conditions ({CONTROLNETS: ControlRun}; {} without a
        request): the family's `_conditions`, which knows the request's size and batch, returns it."""
        if request is None:
            return {}
        cache = self._calls.current.cache_config
        if not self.runs_with_step_caches and cache is not None:
            raise ValueError(f"control_image= with cache={cache.spelled}: {self.family}'s "
                             "ControlNet residuals are added between the transformer's blocks, which a cached step "
                             "skips; run the ControlNets without a step cache")
        images = [self._control_input(name, given, request, height, width, n_images, per_prompt, cfg)
                  for name, given in zip(self.controlnets(), request.images)]
        shared = cfg and self.guided_halves_share_residuals
        run = ControlRun(self.controlnets(), images, request, half=shared or (cfg and request.guess_mode),
                         zero_uncond=not shared)
        return {CONTROLNETS: run}

    def _control_input(self, name, given, request, height, width, n_images, per_prompt, cfg) -> np.ndarray:
        """A ControlNet's controlnet_cond, as diffusers' prepare_image makes it: the image resized, in [0, 1];
        one image serves every image to generate, a batch is one per prompt; doubled under guidance (not in
        guess mode, where the ControlNets see the conditional half only)."""
        pixels = to_model_input(given, height, width, self.constants["vae_scale_factor"])
        image = (pixels + np.float32(1)) / np.float32(2)
        return self._control_batch(name, image, n_images, per_prompt, cfg and not request.guess_mode)

    @staticmethod
    def _control_batch(name, image, n_images, per_prompt, double) -> np.ndarray:
        repeat = n_images if len(image) == 1 else per_prompt
        if len(image) * repeat != n_images:
            raise ValueError(f"control_image of {name}: {len(image)} images for {n_images} images to generate; "
                             "pass one, or one per prompt")
        image = np.repeat(image, repeat, axis=0)
        return np.concatenate([image, image]) if double else image

    def _evaluate(self, step, num_steps, x, t, conditions, context="batch", engine=None):
        if CONTROLNETS in conditions:  # the ControlNets' guidance window is counted in steps
            conditions[CONTROLNETS].step = (step, num_steps)
        return super()._evaluate(step, num_steps, x, t, conditions, context, engine)

    def _predict(self, x, t, conditions: dict, release: bool, engine: str | None = None, **extra) -> dict:
        # an inpainting UNet's extra channels are not the ControlNets'
        latents = x[:, :self.manifest["constants"]["latent_channels"]]
        feeds = {k: v for k, v in conditions.items() if k != CONTROLNETS}
        residuals = self._control_residuals(engine, latents, np.full(len(x), t, dtype=np.float32), feeds, release,
                                            conditions.get(CONTROLNETS))
        return super()._predict(x, t, {**feeds, **residuals}, release, engine, **extra)

    def _control_residuals(self, engine, latents, timestep, conditions: dict, release: bool,
                           control: ControlRun | None, **unbatched) -> dict:
        """{residual input: array} for the denoiser graph `engine` (default: the denoiser; DeepCache's shallow
        branch takes some only): the scaled residuals of the `control` ControlNets that run at this step,
        summed, or zeros. The ControlNets read `latents` (their first input), `timestep`, the `conditions` they
        take (batch-major: guess mode halves them) and the `unbatched` inputs they take (Flux's ids)."""
        specs = self._residual_inputs()
        if not specs:
            return {}
        accepted = {i["name"] for i in self.manifest["submodules"][engine or self.constants["denoiser"]]["inputs"]}
        total, whole = None, latents
        if control is not None:
            if control.half:
                n = len(latents) // 2
                latents, timestep, conditions = latents[n:], timestep[n:], {k: v[n:] for k, v in conditions.items()}
            for k, name in enumerate(control.engines):
                scale = control.scale(k)
                if scale == 0:
                    continue
                entry = self.manifest["submodules"][name]
                # A step the guidance rule runs on the prompt's half alone (Z-Image's cfg_truncation) takes half
                # of the doubled control input (whose halves are alike)
                image = control.images[k][:len(latents)]
                feeds = {**conditions, **unbatched, entry["inputs"][0]["name"]: latents, "timestep": timestep,
                         "controlnet_cond": image,
                         "conditioning_scale": control.factors(scale, len(entry["outputs"]))}
                if control.request.modes and control.request.modes[k] is not None:
                    feeds["controlnet_mode"] = np.full((len(latents), 1), control.request.modes[k], dtype=np.int64)
                out = self.run(name, release=release, **{i["name"]: feeds[i["name"]] for i in entry["inputs"]})
                residuals = self._residual_feeds(name, out, specs)
                total = [r.copy() for r in residuals] if total is None else [a + r for a, r in zip(total, residuals)]
            if total is not None and control.half:
                total = [np.concatenate([np.zeros_like(r) if control.zero_uncond else r, r]) for r in total]
        found = self._zeros(specs, whole, conditions) if total is None else {s["name"]: r for s, r in zip(specs, total)}
        return {name: r for name, r in found.items() if name in accepted}

    def _residual_feeds(self, name: str, out: dict, specs: list[dict]) -> list[np.ndarray]:
        """ControlNet `name`'s outputs as the denoiser's residual inputs `specs`: the UNet's are named alike."""
        return [out[s["name"]] for s in specs]

    def _residual_dims(self, x: np.ndarray, conditions: dict) -> dict:
        """The sizes of the residual inputs' dims for the latents `x` and the step's `conditions` (besides the
        constants): the UNet's latent sides at 1/S (latent_height_S)."""
        dims = {"batch": x.shape[0], "latent_height": x.shape[2], "latent_width": x.shape[3]}
        for d in {d for s in self._residual_inputs() for d in s["shape"] if isinstance(d, str) and d not in dims}:
            if d.startswith("latent_"):  # latent_height_4: the latent side over 4
                axis, over = d.rsplit("_", 1)
                dims[d] = dims[axis] // int(over)
        return dims

    def _zeros(self, specs: list[dict], x: np.ndarray, conditions: dict) -> dict[str, np.ndarray]:
        """Zero residuals for the latents `x` and the step's `conditions` (made once per shape)."""
        cache = self.__dict__.setdefault("_zero_residuals", {})
        dims = {**self.manifest["constants"], **self._residual_dims(x, conditions)}
        shapes = {s["name"]: tuple(dims[d] if isinstance(d, str) else d for d in s["shape"]) for s in specs}
        key = tuple(shapes.items())
        zeros = cache.get(key)
        if zeros is None:  # (two calls at once of other shapes: each keeps the zeros it made)
            zeros = {name: np.zeros(shape, dtype=np.float32) for name, shape in shapes.items()}
            cache.clear()  # one shape at a time: a request's
            cache[key] = zeros
        return zeros
