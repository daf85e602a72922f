"""What every video family's runner shares (Wan, LTX-Video): 5-D latents (N, C, frames, h, w) in the image loop,
frame counts of the form k x the VAE's temporal scale + 1, and outputs as diffusers' `.frames`: "np" (N, F, H, W, 3)
floats in [0, 1] (the default), "pil" a list of frame lists, "latent" the latents; runners/video.py writes an mp4 or a
folder of PNGs."""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from runners.latents import LatentLayout
from runners.options import REQUEST, Option
from runners.schedulers.schedule import check_steps
from runners.text_to_image import TEXT, TextToImage, _is_int, _prompts

log = logging.getLogger("runners")

OUTPUT_TYPES = ("np", "pil", "latent")
FRAME_MASK = "frame_mask"  # a condition the runner reads, not a graph input: 1 on the tokens kept as given


class FirstFrame(NamedTuple):
    """Image to video's hook in the loop (the interface of runners/conditioning/inpainting.py): the first latent
    frame, the image's, is put back after every step. LTX-Video steps the later frames only; Wan 2.2 TI2V steps all
    and gives the transformer the image's frame: the same, as each latent's step reads only its own elements."""
    first: np.ndarray  # (N, C, 1, h, w)

    def inputs(self, x: np.ndarray) -> np.ndarray:
        return x

    def blend(self, latents: np.ndarray, schedule, i: int) -> np.ndarray:
        return np.concatenate([self.first, latents[:, :, 1:]], axis=2)


def first_frame_mask(rows: int, frames: int, frame_tokens: int) -> np.ndarray:
    """FRAME_MASK of `rows` of a clip of `frames` latent frames, `frame_tokens` tokens each: the first frame's."""
    mask = np.zeros((rows, frames, frame_tokens), dtype=np.float32)
    mask[:, 0] = 1
    return mask.reshape(rows, -1)


def token_timesteps(t, rows: int, tokens: int, conditions: dict) -> tuple[dict, np.ndarray]:
    """(the conditions the transformer takes, a timestep per token (rows, tokens)): `t`, 0 on the tokens kept as
    given (diffusers: t * (1 - conditioning_mask))."""
    timestep = np.full((rows, tokens), t, dtype=np.float32)
    if FRAME_MASK in conditions:
        timestep = timestep * (np.float32(1) - conditions[FRAME_MASK])
    return {k: v for k, v in conditions.items() if k != FRAME_MASK}, timestep


def video_request_options(default_size: str) -> tuple[Option, ...]:
    """The image loop's request options, worded for a video (`default_size`: the family's default frame size)."""
    words = {"height": f"frame height in pixels (default: {default_size} where the artifact's range holds it, else "
                       "its opt size)",
             "width": "frame width in pixels",
             "negative_prompt": "what the video should not show (one, or one per prompt; default \"\"); used "
                                "with guidance",
             "output_type": "np (N, F, H, W, 3) in [0, 1], pil (lists of frames) or latent"}
    return tuple(replace(o, help=words[o.name], default="np" if o.name == "output_type" else o.default)
                 if o.name in words else o
                 for o in REQUEST if o.name not in ("num_images_per_prompt", "vae_tiling"))


def frames_option(default: int) -> Option:
    return Option("num_frames", "int", "frames of the video: k x the VAE's temporal scale + 1 (others are rounded "
                  f"down with a warning; default {default} where the artifact's range holds it)",
                  within=lambda v: v >= 1, allowed="an integer >= 1")


NUM_VIDEOS = Option("num_videos_per_prompt", "int", "videos per prompt", default=1, within=lambda v: v >= 1,
                    allowed="an integer >= 1", flag="--num-videos")


class TextToVideo(TextToImage):
    layout = LatentLayout(video=True)  # a call returns each video's frames (runners/video.py writes them)

    def _video_request(self, prompt, num_inference_steps, guidance_scale, output_type, num_frames) -> tuple:
        """(prompts, steps, guidance scale, frames) of a request, the family's defaults filled in, checked."""
        defaults = self.defaults[TEXT]
        steps = defaults.num_inference_steps if num_inference_steps is None else num_inference_steps
        check_steps(steps, self.manifest["constants"]["num_train_timesteps"])
        self._check_output_type(output_type)
        return (_prompts("prompt", prompt), steps, defaults.guidance_scale if guidance_scale is None else guidance_scale,
                self._num_frames(num_frames))

    def _num_frames(self, num_frames) -> int:
        """The request's frame count as diffusers takes it (k x temporal + 1, others rounded down, with a warning),
        within the artifact's range."""
        temporal = self.constants["vae_temporal_scale"]
        if num_frames is None:
            num_frames = self.constants["default_num_frames"]
        if not _is_int(num_frames) or num_frames < 1:
            raise ValueError(f"num_frames={num_frames!r} is not allowed: use an integer >= 1 of the form "
                             f"{temporal}k + 1")
        if num_frames % temporal != 1:
            rounded = num_frames // temporal * temporal + 1
            log.warning("num_frames - 1 has to be divisible by %d: %d frames rounded to %d, as diffusers does",
                        temporal, num_frames, rounded)
            num_frames = rounded
        lo, hi = self._frame_range()
        if not lo <= num_frames <= hi:
            raise ValueError(f"num_frames={num_frames} is outside this artifact's range {lo}..{hi} ({temporal}k + 1): "
                             "ask for fewer frames, or export the model with a wider --frames range")
        return num_frames

    def _frame_range(self) -> tuple[int, int]:
        """The fewest and most frames the artifact's latent frame range holds."""
        lo, _, hi = self.dims["latent_frames"]
        temporal = self.constants["vae_temporal_scale"]
        return (lo - 1) * temporal + 1, (hi - 1) * temporal + 1

    def calibration_options(self, image, index: int) -> dict:
        """Calibration's clips: 3 latent frames (every graph runs; the transformer's statistics per token are those
        of longer clips) where the artifact's range holds them."""
        lo, hi = self._frame_range()
        return {"num_frames": max(lo, min(1 + 2 * self.constants["vae_temporal_scale"], hi))}

    @staticmethod
    def _check_output_type(output_type) -> None:
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type={output_type!r}; allowed: {', '.join(OUTPUT_TYPES)}")

    @staticmethod
    def _frames_output(video: np.ndarray, output_type: str):
        """Frames (N, F, H, W, 3) in [0, 1] as the request's `output_type` ("np" or "pil") asks."""
        if output_type == "np":
            return video
        from PIL import Image

        return [[Image.fromarray(f) for f in (v * 255).round().astype(np.uint8)] for v in video]
