"""Dynamic dimensions: their min/opt/max ranges, and the concrete shapes the exporter probes.

The ranges go into the manifest, where the engine builders (optimization profiles) and the
runner (input validation) read them.
"""
from __future__ import annotations

from export.registry import ModelEntry
from export.spec import Family, Shape

Range = tuple[int, int, int]
MERGED_PATCHES = 4  # a vision tower's merged token (2 x 2 patches): an image's patches are a multiple


def _resolve(value, constants: dict) -> int:
    return constants[value] if isinstance(value, str) else value


def _derive(family: Family, base: dict[str, int], constants: dict) -> dict[str, int]:
    out = dict(base)
    for dim, rule in family.derived_dims.items():
        if callable(rule):
            out[dim] = rule(base)
            continue
        source, factor, offset = rule
        if source in base:
            out[dim] = base[source] * _resolve(factor, constants) + _resolve(offset, constants)
    return out


def image_multiple(constants: dict) -> int:
    """Image sides are multiples of this: the VAE's scale times the denoiser's latent multiple
    (SD3's patch, a UNet's down-sampling)."""
    return constants["vae_scale_factor"] * constants["latent_multiple"]


def _used(family: Family) -> set[str]:
    return {d for s in family.submodules for t in s.inputs + s.outputs for d in t.shape if isinstance(d, str)}


def dim_ranges(entry: ModelEntry, family: Family, constants: dict) -> dict[str, Range]:
    """min/opt/max of every dynamic dimension the family's tensors use, from the entry's
    image-size and text ranges."""
    scale = constants["vae_scale_factor"]
    latent = tuple(s // scale for s in entry.image_size)
    base = {"batch": entry.batch, "latent_height": latent, "latent_width": latent, "text_length": entry.text_length}
    if "reference_tokens_max" in constants:  # reference images' tokens: none at min and opt, up to the family's budget
        base["reference_tokens"] = (0, 0, constants["reference_tokens_max"])
    if "vision_windows_max" in constants:  # a vision tower's windows of patches (Qwen-Image-Edit's input images)
        base["vision_windows"] = (1, constants["vision_windows_opt"], constants["vision_windows_max"])
    if "vision_patches_max" in constants:  # images padded to one patch count (Qwen-Image 2.1's references)
        base["vision_patches"] = (MERGED_PATCHES, constants["vision_patches_opt"], constants["vision_patches_max"])
        base["vision_images"] = (1, 1, constants["vision_images_max"])
    if entry.frames:  # a video's latent frames: the first frame alone, then one a temporal scale of frames
        base["latent_frames"] = tuple((f - 1) // constants["vae_temporal_scale"] + 1 for f in entry.frames)
    per_bound = [_derive(family, {k: v[i] for k, v in base.items()}, constants) for i in range(3)]
    return {k: (per_bound[0][k], per_bound[1][k], per_bound[2][k]) for k in per_bound[0] if k in _used(family)}


# Capped: a real-size VAE costs 2.6 TFLOP a call at 512x512 (twice, in torch and ORT).
EXAMPLE_CAP = 256


def example_side(entry: ModelEntry, constants: dict) -> int:
    """The square image side the graphs are traced at: the opt size, capped, and at least the min."""
    lo, opt, _ = entry.image_size
    step = image_multiple(constants)
    return max(lo, min(opt, EXAMPLE_CAP) // step * step)


def check_example_size(entry: ModelEntry, specs, constants: dict) -> None:
    """Refuse, before any tracing, a range whose example gives a graph's deepest level (`latent_divisor`) a
    side of 1. torch.export specializes a size of 1: the U-Net with ControlNet inputs then fails to trace,
    and the other graphs (ControlNet, SD3's and Flux's transformers, the VAE) trace but are wrong at every
    other size. Traced at 2 or more, they are right down to a side of 1, so the min size is free."""
    divisors = {s.name: _resolve(s.latent_divisor, constants) for s in specs if s.latent_divisor is not None}
    if not divisors:
        return
    name = max(divisors, key=divisors.get)
    side, scale = example_side(entry, constants), constants["vae_scale_factor"]
    deepest = side // scale // divisors[name]
    if deepest < 2:
        need = 2 * divisors[name] * scale
        bound = "an opt" if need <= EXAMPLE_CAP else "a min"  # the example is the opt size only up to the cap
        raise ValueError(f"--image-size {','.join(map(str, entry.image_size))}: the example size {side} gives "
                         f"{entry.name}'s {name} a deepest latent side of {deepest} ({side} px / {scale} / "
                         f"{divisors[name]}), which torch.export cannot keep dynamic; use {bound} size of at least "
                         f"{need} (a multiple of {image_multiple(constants)})")


def probe_dims(entry: ModelEntry, family: Family, constants: dict) -> list[dict[str, int]]:
    """Two different concrete settings of the dynamic dims: the first is the export example
    (every dynamic size >= 2, so the exporter keeps it symbolic), the second checks that the
    graph generalises (batch 1, non-square, a shorter text)."""
    scale, step = constants["vae_scale_factor"], image_multiple(constants)
    lo, opt, hi = entry.image_size
    if lo + step > hi:
        raise ValueError(f"{entry.name}: image size range {entry.image_size} is too narrow to check two shapes")
    side_a = example_side(entry, constants)
    t5_lo, t5_opt, _ = entry.text_length
    probes = [
        {"batch": 2, "latent_height": side_a // scale, "latent_width": side_a // scale, "text_length": max(2, t5_opt)},
        {"batch": 1, "latent_height": lo // scale, "latent_width": (lo + step) // scale,
         "text_length": max(t5_lo, min(t5_opt, 32) - 5)},
    ]
    # a graph takes reference tokens on their own axis (FLUX.2 klein KV), or with a row of zeros (Qwen-Image 2.1)
    if {"reference_tokens", "reference_rows"} & _used(family):
        probes[0]["reference_tokens"], probes[1]["reference_tokens"] = 4, 2
    if "vision_windows" in _used(family):
        probes[0]["vision_windows"], probes[1]["vision_windows"] = 3, 2
    if "vision_patches" in _used(family):  # whole merged groups of 2 x 2 patches
        probes[0]["vision_patches"], probes[1]["vision_patches"] = 4 * MERGED_PATCHES, 2 * MERGED_PATCHES
        probes[0]["vision_images"], probes[1]["vision_images"] = 2, 1
    if "latent_frames" in _used(family):  # at most 3 latent frames (a video's graphs cost in frames)
        frames_lo, _, frames_hi = dim_ranges(entry, family, constants)["latent_frames"]
        probes[0]["latent_frames"] = max(2, min(3, frames_hi))
        probes[1]["latent_frames"] = frames_lo if frames_lo != probes[0]["latent_frames"] else frames_lo + 1
    return [{k: v for k, v in _derive(family, p, constants).items() if k in _used(family)} for p in probes]


def concrete(shape: Shape, dims: dict[str, int], constants: dict) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) else dims.get(d, constants.get(d)) for d in shape)
