"""Images in and out of the VAE, as diffusers' VaeImageProcessor does it: `to_output` post-processes
the decoder's images; `to_model_input` prepares an image (or an inpainting mask) for the encoder."""
from __future__ import annotations

import numpy as np

def to_output(image: np.ndarray, output_type: str):
    """(N, 3, H, W) in [-1, 1] -> (N, H, W, 3) floats in [0, 1] for "np", PIL images for "pil"."""
    array = np.clip(image / 2 + 0.5, 0, 1).transpose(0, 2, 3, 1)
    if output_type == "np":
        return array
    from PIL import Image

    return [Image.fromarray(a) for a in (array * 255).round().astype(np.uint8)]


def nearest(array: np.ndarray, height: int, width: int) -> np.ndarray:
    """torch.nn.functional.interpolate's default (mode "nearest") on NCHW: source index floor(i * in / out)."""
    rows = np.minimum((np.arange(height) * (array.shape[2] / height)).astype(np.int64), array.shape[2] - 1)
    cols = np.minimum((np.arange(width) * (array.shape[3] / width)).astype(np.int64), array.shape[3] - 1)
    return array[:, :, rows][:, :, :, cols]


def bilinear(array: np.ndarray, height: int, width: int) -> np.ndarray:
    """torch.nn.functional.interpolate's mode "bilinear" on NCHW (align_corners False, no antialias): each
    output pixel's centre mapped back, clamped at the first pixel, between its two nearest rows and columns."""
    def weights(n_out: int, n_in: int):
        source = np.maximum((np.arange(n_out, dtype=np.float32) + np.float32(0.5)) * np.float32(n_in / n_out)
                            - np.float32(0.5), 0)
        low = np.minimum(source.astype(np.int64), n_in - 1)
        return low, np.minimum(low + 1, n_in - 1), (source - low).astype(np.float32)

    r0, r1, fr = weights(height, array.shape[2])
    c0, c1, fc = weights(width, array.shape[3])
    rows = array[:, :, r0] * (1 - fr)[:, None] + array[:, :, r1] * fr[:, None]
    return (rows[..., c0] * (1 - fc) + rows[..., c1] * fc).astype(np.float32)


def _as_list(name: str, value) -> list:
    from PIL import Image

    items = value if isinstance(value, (list, tuple)) else [value]
    if not items or not all(isinstance(i, (Image.Image, np.ndarray)) for i in items) or \
            len({type(i) for i in items}) != 1:
        raise ValueError(f"{name} must be a PIL image, a numpy array (H, W, C) in [0, 1], or a non-empty list of "
                         f"one of those; got {type(value).__name__}")
    return list(items)


def _sizes(value, mask: bool) -> set[tuple[int, int]]:
    """(height, width) of each image of an argument (numpy: (H, W, C), (N, H, W, C), or a mask's (H, W))."""
    from PIL import Image

    items = _as_list("mask_image" if mask else "image", value)
    if isinstance(items[0], Image.Image):
        return {(i.height, i.width) for i in items}
    return {tuple(a.shape) if mask and a.ndim == 2 else tuple(a.shape[-3:-1]) for a in items}


def check_mask_size(image, mask_image) -> None:
    """diffusers resizes both to the requested size, whatever they were; a mask of another size than
    its image's is more likely the wrong mask than a coarser one, so it is refused."""
    images, masks = _sizes(image, mask=False), _sizes(mask_image, mask=True)
    if masks != images:
        said = lambda sizes: " and ".join(f"{h}x{w}" for h, w in sorted(sizes))
        raise ValueError(f"mask_image is {said(masks)} but image is {said(images)} (height x width): pass a mask of "
                         "the image's size (white repaints, black keeps)")


def to_model_input(value, height: int | None, width: int | None, multiple: int, mask: bool = False) -> np.ndarray:
    """An image argument -> NCHW float32, as diffusers' image processor (mask=False: RGB in [-1, 1])
    or mask processor (mask=True: grayscale, binarized at 0.5, not normalized) prepares it.

    PIL images are resized with Lanczos to (height, width); numpy arrays (H, W, C) or (N, H, W, C)
    in [0, 1] with nearest neighbours, as torch's interpolate does. A size left None is the image's
    own, rounded down to `multiple` (the VAE's scale factor). PIL images are converted to RGB (or
    grayscale for a mask) first, so alpha and palette images are taken; a numpy image must have 3
    channels (a mask 1, or none)."""
    from PIL import Image

    name = "mask_image" if mask else "image"
    items = _as_list(name, value)
    if isinstance(items[0], Image.Image):
        h = height or items[0].height - items[0].height % multiple
        w = width or items[0].width - items[0].width % multiple
        mode = "L" if mask else "RGB"
        # diffusers resizes, then converts a mask to grayscale (the order changes the rounding); an image
        # that is not RGB (alpha, palette, grayscale) is converted first, as diffusers' load_image does.
        keep = ("RGB", "L") if mask else ("RGB",)
        arrays = [np.asarray((i if i.mode in keep else i.convert(mode)).resize((w, h), resample=Image.LANCZOS)
                             .convert(mode), dtype=np.float32) / 255 for i in items]
        array = np.stack(arrays)
        array = array[:, None] if mask else array.transpose(0, 3, 1, 2)
    else:
        array = np.concatenate([a if a.ndim == 4 else a[None] for a in items]).astype(np.float32)
        if mask and array.ndim == 4 and array.shape[-1] != 1 or not mask and (array.ndim != 4 or array.shape[-1] != 3):
            raise ValueError(f"{name}: a numpy {'mask' if mask else 'image'} is (H, W{'' if mask else ', 3'}) or "
                             f"(N, H, W{', 1' if mask else ', 3'}) with values in [0, 1]; got shape "
                             f"{items[0].shape}")
        array = (array[:, None] if array.ndim == 3 else array.transpose(0, 3, 1, 2))
        h = height or array.shape[2] - array.shape[2] % multiple
        w = width or array.shape[3] - array.shape[3] % multiple
        array = nearest(array, h, w)
    if mask:
        return np.where(array < 0.5, np.float32(0), np.float32(1))
    return array * 2 - 1
