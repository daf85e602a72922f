"""What one benchmark call feeds each submodule, read from the model's family spec
(export/families) and export manifest: which submodules a text-to-image run calls, the dims of
one call at an image size, and seeded inputs of those shapes. Nothing here names a family's
submodules, so a U-Net's graphs are fed as SD3's are.

The input specs are plain JSON ({submodule: {input: {"shape", "dtype", "high"}}}): the parent
makes them, and a worker process, which may live in a peer's environment, only fills them."""
from __future__ import annotations

import dataclasses

import numpy as np

PROMPT = "a photo of an astronaut riding a horse on the moon, detailed, golden light"  # every variant's
T5_LENGTH = 256  # diffusers' default max_sequence_length: a call's text length where the family has one
DENOISER_BATCH = 2  # the denoiser runs the prompt and the negative prompt together (guidance)


def denoiser(manifest: dict) -> str:
    """The submodule run at every step (the family spec marks it for the precision passes)."""
    return next(name for name, sub in manifest["submodules"].items() if sub["quantization"].get("denoiser"))


def text_encoders(manifest: dict) -> list[str]:
    """The submodules fed token ids."""
    return [name for name, sub in manifest["submodules"].items()
            if any(t["dtype"].startswith("int") for t in sub["inputs"])]


def text_to_image(manifest: dict) -> list[str]:
    """The submodules a text-to-image run calls, in order (the VAE encoder is for image inputs)."""
    return [*text_encoders(manifest), denoiser(manifest), "vae_decoder"]


def call_dims(src, constants: dict, size: int, batch: int) -> dict[str, int]:
    """The dynamic dims of one call at `size` x `size` pixels: the model's dim ranges (the same
    rules the export used) narrowed to one point."""
    from export.shapes import dim_ranges

    point = dataclasses.replace(src.entry, image_size=(size,) * 3, batch=(batch,) * 3, text_length=(T5_LENGTH,) * 3)
    return {dim: lo for dim, (lo, _, _) in dim_ranges(point, src.family, constants).items()}


def input_specs(src, manifest: dict, size: int, names: list[str]) -> dict[str, dict[str, dict]]:
    """{submodule: {input: {"shape", "dtype", "high"}}} of one call of each of `names` at `size`
    (`src`: the model's export.source.ModelSource, `manifest`: its export's): the denoiser at
    batch 2, the others at batch 1."""
    from export.shapes import concrete

    specs, constants = {s.name: s for s in src.family.submodules if s.applies(src)}, manifest["constants"]
    out = {}
    for name in names:
        dims = call_dims(src, constants, size, DENOISER_BATCH if name == denoiser(manifest) else 1)
        out[name] = {t.name: {"shape": list(concrete(t.shape, dims, constants)), "dtype": t.dtype,
                              "high": constants[t.high] if isinstance(t.high, str) else t.high}
                     for t in specs[name].inputs}
    return out


def make_inputs(specs: dict[str, dict[str, dict]]) -> dict[str, dict[str, np.ndarray]]:
    """Seeded arrays for `input_specs`: token ids uniform below their vocabulary, a float with a
    bound (a timestep) uniform below it, other floats standard normal; the same in every process."""
    rng = np.random.default_rng(0)
    out = {}
    for submodule, inputs in specs.items():
        out[submodule] = {}
        for name, t in inputs.items():
            dtype = np.dtype(t["dtype"])
            if dtype.kind in "iu":
                value = rng.integers(0, t["high"], t["shape"], dtype=dtype)
            elif t["high"] is not None:
                value = rng.uniform(0, t["high"], t["shape"]).astype(dtype)
            else:
                value = rng.standard_normal(t["shape"], dtype=np.float32).astype(dtype)
            out[submodule][name] = value
    return out


def start_latents(constants: dict, height: int, width: int, frames: int | None = None) -> np.ndarray:
    """The run's starting latents (1, C, h, w); a video's of `frames` frames (1, C, (frames - 1) / 4 + 1, h, w)."""
    scale = constants["vae_scale_factor"]
    video = () if frames is None else ((frames - 1) // constants["vae_temporal_scale"] + 1,)
    shape = (1, constants["latent_channels"], *video, height // scale, width // scale)
    return np.random.default_rng(42).standard_normal(shape, dtype=np.float32)


def reference_images(count: int, height: int, width: int) -> list:
    """`count` seeded images of the run's size to edit from: smooth colour fields (a VAE's latents of pure noise
    would be unlike a photo's)."""
    from PIL import Image

    rng = np.random.default_rng(7)
    images = []
    for _ in range(count):
        small = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
        images.append(Image.fromarray(small).resize((width, height), Image.BICUBIC))
    return images
