"""A video's frames to files: an H.264 mp4 through PyAV (the `video` extra; its wheels carry FFmpeg with
libx264) or a folder of PNGs through Pillow. Both are written beside their destination and renamed into place
when whole, so an interrupted run leaves no half-written clip."""
from __future__ import annotations

import io
import os
import shutil
from fractions import Fraction
from pathlib import Path

import numpy as np

VIDEO_SUFFIXES = (".mp4",)


def _uint8(frames) -> np.ndarray:
    """(F, H, W, 3) floats in [0, 1] (or PIL images, or uint8) -> uint8, rounded as PIL output is."""
    frames = np.stack([np.asarray(f) for f in frames])
    return frames if frames.dtype == np.uint8 else (np.clip(frames, 0, 1) * 255).round().astype(np.uint8)


def _encode_mp4(frames, out, fps: float, crf: int) -> None:
    """`frames` as an H.264 mp4 (yuv420p, constant rate factor `crf`: lower is closer to the frames) at `fps`, into
    `out` (a path or a seekable file object)."""
    try:
        import av
    except ImportError:
        raise ValueError("writing mp4 needs PyAV: pip install 'diffusion-aot[video]' (or write PNG frames: --out "
                         "FOLDER)") from None
    frames = _uint8(frames)
    with av.open(out, mode="w", format="mp4") as container:
        # a rate as a fraction (PyAV's): 25, 12.5 = 25/2, 23.976 = 24000/1001
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001), options={"crf": str(crf)})
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())  # flush the encoder's delayed frames


def write_mp4(frames, path, fps: float, crf: int = 18) -> None:
    """`frames` as an mp4 file at `path` (see _encode_mp4), written beside it and renamed into place when whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.partial{path.suffix}")
    try:
        _encode_mp4(frames, str(temp), fps, crf)
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)


def mp4_bytes(frames, fps: float, crf: int = 18) -> bytes:
    """`frames` as the bytes of an mp4 file (a server's answer)."""
    buffer = io.BytesIO()
    _encode_mp4(frames, buffer, fps, crf)
    return buffer.getvalue()


def write_frames(frames, folder) -> None:
    """`frames` as folder/frame_0000.png, ...: the folder is written beside its place and renamed into it (an
    existing one is replaced only when the new one is whole)."""
    from PIL import Image

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    temp = folder.with_name(f".{folder.name}.partial")
    shutil.rmtree(temp, ignore_errors=True)  # an interrupted run's
    temp.mkdir()
    try:
        for i, frame in enumerate(_uint8(frames)):
            Image.fromarray(frame).save(temp / f"frame_{i:04d}.png")
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(temp, folder)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def read_mp4(source) -> tuple[np.ndarray, float]:
    """(frames (F, H, W, 3) uint8, frames per second) of an mp4 (a path, or its bytes), decoded by PyAV."""
    import av

    with av.open(io.BytesIO(source) if isinstance(source, bytes) else str(source)) as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        return frames, float(stream.average_rate)


def write_video(frames, out, fps: float) -> None:
    """An mp4 when `out` ends in .mp4, else a folder of PNGs."""
    if Path(out).suffix.lower() in VIDEO_SUFFIXES:
        write_mp4(frames, out, fps)
    else:
        write_frames(frames, out)
