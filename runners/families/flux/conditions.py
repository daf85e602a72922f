"""What FLUX.1's conditioned models read beside the latents, prepared as their diffusers pipelines do:
FLUX.1 Canny/Depth's control image as latents concatenated on the channel axis (FluxControlPipeline; a
Flux ControlNet's are the same latents, packed), and FLUX.1 Kontext's reference image as tokens appended
to the image's (FluxKontextPipeline), with Kontext's size rules. (FLUX.1 Fill's masked image and mask
are inpainting's: FluxPipeline.)"""
from __future__ import annotations

import numpy as np

from runners.conditioning.images import to_model_input
from runners.text_to_image import given_or_drawn

# FluxKontextPipeline's PREFERRED_KONTEXT_RESOLUTIONS, (width, height): the sizes Kontext was trained at
KONTEXT_RESOLUTIONS = ((672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184),
                       (944, 1104), (1024, 1024), (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752),
                       (1456, 720), (1504, 688), (1568, 672))
KONTEXT_MAX_AREA = 1024**2  # FluxKontextPipeline's max_area


def control_pixels(pipe, control_image, height, width, n_images) -> np.ndarray:
    """The control image prepared as an image (resized, in [-1, 1]), repeated for the images to generate
    (each one's own, repeat_interleave): (n_images, 3, height, width)."""
    pixels = to_model_input(control_image, height, width, multiple=pipe.constants["vae_scale_factor"])
    if n_images % len(pixels):
        raise ValueError(f"{len(pixels)} control images for {n_images} images to generate: pass one, or one per prompt")
    return np.repeat(pixels, n_images // len(pixels), axis=0)


def control_latents(pipe, control_image, height, width, n_images, noise, seed, vae_tiling,
                    stream: int = 1) -> np.ndarray:
    """FluxControlPipeline's control latents: `control_pixels`, then a sample of its VAE
    posterior (`noise`, or drawn from a `stream` of `seed` the latents' does not use), scaled."""
    pixels = control_pixels(pipe, control_image, height, width, n_images)
    shape = pipe.layout.shape(pipe, n_images, height, width)
    noise = given_or_drawn("control_noise", noise, shape, np.random.default_rng(None if seed is None else (seed, stream)))
    return pipe._image_latents(pixels, n_images, noise, vae_tiling)


def kontext_size(height: int, width: int, max_area: int, multiple: int) -> tuple[int, int]:
    """FluxKontextPipeline's output size: the requested aspect ratio at `max_area` pixels, rounded down to
    `multiple` (whatever size was asked for)."""
    if isinstance(max_area, bool) or not isinstance(max_area, (int, np.integer)) or max_area < multiple**2:
        raise ValueError(f"max_area={max_area!r} is not allowed: use an integer number of pixels >= {multiple**2}")
    ratio = width / height
    return (round((max_area / ratio) ** 0.5) // multiple * multiple,
            round((max_area * ratio) ** 0.5) // multiple * multiple)


def _image_size(image) -> tuple[int, int]:
    """(height, width) of the first of an image argument: PIL, or numpy (H, W, 3) or (N, H, W, 3)."""
    first = image[0] if isinstance(image, (list, tuple)) else image
    if hasattr(first, "height"):
        return first.height, first.width
    shape = np.shape(first)
    return shape[-3], shape[-2]


def reference_size(image, auto_resize: bool, multiple: int) -> tuple[int, int]:
    """FluxKontextPipeline's reference size: the image's own rounded down to `multiple`, or (auto_resize)
    the trained resolution of the nearest aspect ratio."""
    height, width = (side - side % multiple for side in _image_size(image))
    if auto_resize:
        _, width, height = min((abs(width / height - w / h), w, h) for w, h in KONTEXT_RESOLUTIONS)
    return height // multiple * multiple, width // multiple * multiple


def reference_latents(pipe, image, auto_resize: bool, vae_tiling, n_images: int) -> np.ndarray:
    """FluxKontextPipeline's reference: the image's VAE latents (the posterior's mode), scaled, repeated for
    the images to generate (the whole batch, as diffusers repeats it)."""
    multiple = pipe.constants["vae_scale_factor"] * pipe.layout.patch
    pixels = to_model_input(image, *reference_size(image, auto_resize, multiple), multiple=multiple)
    if n_images % len(pixels):
        raise ValueError(f"{len(pixels)} reference images for {n_images} images to generate: pass one, or one per "
                         "prompt")
    z = pipe.layout.normalisation.from_vae(pipe, pipe.vae_encode(pixels, tiling=vae_tiling)[0])
    return np.concatenate([z] * (n_images // len(z)))
