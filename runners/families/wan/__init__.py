"""Wan 2.1 and 2.2 text to video, with the semantics of diffusers' WanPipeline: each prompt cleaned (ftfy where it
is installed, HTML entities, whitespace) through UMT5 with a mask, its states zeroed past its tokens and padded with
zeros to `max_sequence_length` (runners/prompts.py's "zeroed"; the encoder runs on the call's longest prompt,
which its output does not depend on); the transformer on 5-D latents (N, 16, (F - 1) / 4 + 1, H / 8, W / 8) with
classifier-free guidance above 1 (the negative prompt "" by default); UniPC on flow sigmas (the folder's
scheduler); and the causal VAE decoded one latent frame at a time, its feature cache carried between the chunk
graphs (export/families/wan.py), so the decoder's memory does not grow with the clip.

Image to video (`image=`), as WanImageToVideoPipeline: Wan 2.2 TI2V-5B (model_index.json's `expand_timesteps`; 48
latent channels at 16 x 16 pixels, a timestep per token) keeps the image's latent (the VAE's posterior mean) as the
first latent frame, at timestep 0; Wan 2.1 I2V gives its transformer, at every step, a mask of the first frame and the
latents of a clip of the image followed by grey frames as 20 more channels, and the image's CLIP states.

Outputs as diffusers' `.frames`: "np" (N, F, H, W, 3) floats in [0, 1] (the default), "pil" a list of frame lists,
"latent" the latents; runners/video.py writes an mp4 or a folder of PNGs."""
from __future__ import annotations

import html
import logging
import re

import numpy as np

from runners.adapters.lora import register_key_spelling
from runners.conditioning.clip_images import clip_pixel_values
from runners.conditioning.images import to_model_input
from runners.conditioning.inpainting import Inpainting
from runners.families.wan import latent_rgb, lora_keys
from runners.guidance import ClassifierFree
from runners.latents import LatentLayout
from runners.options import Option, options
from runners.prompts import encode_prompts
from runners.text_to_image import TEXT, Defaults, Handover, _is_int, given_or_drawn
from runners.text_to_video import (FRAME_MASK, NUM_VIDEOS, FirstFrame, TextToVideo, first_frame_mask, frames_option,
                                   token_timesteps, video_request_options)

IMAGE_STATES = "encoder_hidden_states_image"  # Wan 2.1 I2V's transformer input: the image's CLIP states

log = logging.getLogger("runners")


def prompt_clean(text: str) -> str:
    """WanPipeline's prompt_clean: ftfy's fix_text where ftfy is installed (as there), HTML entities unescaped
    twice, whitespace collapsed."""
    try:
        import ftfy
        text = ftfy.fix_text(text)
    except ImportError:
        pass
    return re.sub(r"\s+", " ", html.unescape(html.unescape(text)).strip()).strip()


class WanPipeline(TextToVideo):
    family = "wan"
    # WanPipeline runs the prompt's and the negative prompt's predictions as two calls ("cond", "uncond")
    guidance = ClassifierFree(contexts="uncond,cond")
    defaults = {TEXT: Defaults(50, 5.0)}
    # the transformer patches the latents itself (a token a 1 x 2 x 2 patch); the VAE's graphs hold its statistics
    layout = LatentLayout(video=True, latent_rgb=latent_rgb.BY_CHANNELS)
    options = options(
        video_request_options("480 x 832"), guidance.options,
        (frames_option(81), NUM_VIDEOS,
         Option("image", "image", "image to video (Wan 2.1 I2V, Wan 2.2 TI2V): the first frame", group="image"),
         Option("max_sequence_length", "int", "UMT5 tokens of a prompt (WanPipeline's 512)", default=512,
                within=lambda v: v >= 1, allowed="an integer >= 1"),
         Option("guidance_scale_2", "float", "Wan 2.2 A14B: the guidance scale of the low-noise transformer, below "
                "the boundary step (default: guidance_scale)", allowed="a finite number")))

    def generate(self, prompt, negative_prompt=None, image=None, height=None, width=None, num_frames=None,
                 num_inference_steps=None, guidance_scale=None, num_videos_per_prompt=1, seed=None, latents=None,
                 output_type="np", max_sequence_length=512, guidance_scale_2=None):
        """Generate videos (call the pipeline: `pipe(prompt, ...)`). `latents` as WanPipeline takes them:
        (N, C, (num_frames - 1) / 4 + 1, height / s, width / s) (Wan 2.1: C 16, s 8; Wan 2.2 TI2V-5B: 48, 16). On a
        Wan 2.2 A14B artifact, `transformer_2` runs the steps below its boundary, with `guidance_scale_2`. With
        `image` (Wan 2.2 TI2V-5B, Wan 2.1 I2V), the video starts from it."""
        c = self.constants
        self._check_image_to_video(image, max_sequence_length)
        handover = self._handover(guidance_scale, guidance_scale_2)
        prompts, steps, guidance_scale, num_frames = self._video_request(prompt, num_inference_steps, guidance_scale,
                                                                         output_type, num_frames)
        height, width = self._on_grid(c["default_height"] if height is None else height,
                                      c["default_width"] if width is None else width)
        lo, _, hi = self.dims["text_length"]
        if not lo <= max_sequence_length <= hi:
            raise ValueError(f"max_sequence_length={max_sequence_length} is outside this artifact's range {lo}..{hi}")
        n_videos = len(prompts) * num_videos_per_prompt
        cfg = self.guidance.on(guidance_scale)
        self._check(height, width, n_videos * (2 if cfg else 1), "np")
        with self._timed("text_encoders"):
            conditions = self._conditions(prompts, negative_prompt, num_videos_per_prompt, cfg, max_sequence_length)
        shape = self.layout.shape(self, n_videos, height, width, num_frames)
        latents = given_or_drawn("latents", latents, shape, np.random.default_rng(seed))
        schedule = self.scheduler.start(steps)
        latents = latents * np.float32(schedule.init_noise_sigma)
        hook = None
        if image is not None:
            with self._timed("vae_encode"):
                latents, hook = self._image_condition(image, latents, conditions, len(prompts), num_videos_per_prompt,
                                                      (height, width, num_frames), cfg)
        with self._timed("denoise"):
            latents = self._denoise(latents, schedule, guidance_scale, conditions, inpainting=hook, handover=handover)
        if output_type == "latent":
            return latents
        with self._timed("vae_decode"):
            return self._frames_output(self.decode_video(latents), output_type)

    def _handover(self, guidance_scale, guidance_scale_2) -> Handover | None:
        """Wan 2.2 A14B's: `transformer_2` below boundary_ratio x the training timesteps, its guidance scale
        `guidance_scale_2` (default the first's, as diffusers'). Refused as diffusers refuses it without a boundary."""
        ratio = self.constants.get("boundary_ratio")
        if ratio is None:
            if guidance_scale_2 is not None:
                raise ValueError("guidance_scale_2 is Wan 2.2 A14B's (its transformer_2 after the boundary step); this "
                                 "artifact has one transformer: leave it out")
            return None
        first = self.defaults[TEXT].guidance_scale if guidance_scale is None else guidance_scale
        return Handover(ratio * self.manifest["constants"]["num_train_timesteps"], "transformer_2",
                        first if guidance_scale_2 is None else guidance_scale_2)

    def inpainting_denoiser(self) -> bool:
        """Wan 2.1 I2V's transformer reads more channels than the latents have, but an image's, not a mask's."""
        return False

    def _check_image_to_video(self, image, max_sequence_length) -> None:
        c = self.constants
        if image is None and c.get("condition_channels"):
            raise ValueError("this artifact is image to video (WanImageToVideoPipeline: its transformer reads the "
                             "image as channels): give image=")
        if image is not None and not (c.get("expand_timesteps") or c.get("condition_channels")):
            raise ValueError("image to video is Wan 2.2 TI2V-5B's and Wan 2.1 I2V's; this artifact is text to video "
                             "only: leave image out")
        if "image_encoder" in self.manifest["submodules"] and max_sequence_length != c["max_text"]:
            raise ValueError(f"max_sequence_length={max_sequence_length}: Wan 2.1 I2V's attention takes the image's "
                             f"states as all but the last {c['max_text']} (WanImageToVideoPipeline's split): leave it "
                             f"at {c['max_text']}")

    def _image_condition(self, image, latents, conditions: dict, n_prompts: int, per_prompt: int, size: tuple,
                         cfg: bool) -> tuple:
        """(latents, the loop's hook) of image to video, the conditions completed. Wan 2.2 TI2V-5B: the image's
        latent is the first latent frame, its tokens at timestep 0. Wan 2.1 I2V: a mask of the first frame and the
        latents of the image followed by grey frames (zeros) as channels, and the image's CLIP states."""
        height, width, frames = size
        rows = len(latents) * (2 if cfg else 1)
        if self.constants.get("expand_timesteps"):
            first = self._condition_latents(image, n_prompts, per_prompt, height, width, 1)
            conditions[FRAME_MASK] = first_frame_mask(rows, latents.shape[2],
                                                      self.hidden_tokens((1, *latents.shape[3:]), conditions))
            return np.concatenate([first, latents[:, :, 1:]], axis=2), FirstFrame(first)
        condition = self._condition_latents(image, n_prompts, per_prompt, height, width, frames)
        mask = np.zeros((len(condition), self.constants["vae_temporal_scale"], *condition.shape[2:]), np.float32)
        mask[:, :, 0] = 1
        if "image_encoder" in self.manifest["submodules"]:
            pixels = clip_pixel_values(image, self.constants["image_processor"])
            states = self._per_video(self.run("image_encoder", pixel_values=pixels)["image_embeds"], n_prompts,
                                     per_prompt)
            conditions[IMAGE_STATES] = self.guidance.batch(states, states) if cfg else states
        # an inpainting denoiser's extra channels, as SD1.5's 9-channel U-Net reads its mask and masked image's
        channels = np.concatenate([mask, condition], axis=1)
        channels = self.guidance.batch(channels, channels) if cfg else channels
        return latents, Inpainting(mask=None, noise=None, image_latents=None, channels=channels)

    def _condition_latents(self, image, n_prompts: int, per_prompt: int, height: int, width: int,
                           frames: int) -> np.ndarray:
        """The VAE's posterior mean (N, C, f, h, w), normalised, of a clip of `frames` frames: the image (one, or one
        per prompt) first, zeros (grey) after; WanImageToVideoPipeline's "argmax" of its video condition."""
        pixels = to_model_input(image, height, width, multiple=self.constants["vae_scale_factor"])
        clip = np.zeros((len(pixels), 3, frames, height, width), np.float32)
        clip[:, :, 0] = pixels
        return self._per_video(self.encode_video(clip)[0], n_prompts, per_prompt)

    @staticmethod
    def _per_video(per_image: np.ndarray, n_prompts: int, per_prompt: int) -> np.ndarray:
        """Rows of one image, or one per prompt, repeated for each prompt's videos."""
        if len(per_image) not in (1, n_prompts):
            raise ValueError(f"{len(per_image)} images for {n_prompts} prompts: give one, or one per prompt")
        return np.repeat(np.broadcast_to(per_image, (n_prompts, *per_image.shape[1:])), per_prompt, axis=0)

    def _predict(self, x, t, conditions: dict, release: bool, engine: str | None = None, **extra) -> dict:
        """Wan 2.2 TI2V-5B's transformer takes a timestep per token (0 on an image's first frame)."""
        if not self.constants.get("expand_timesteps"):
            return super()._predict(x, t, conditions, release, engine, **extra)
        feeds, timestep = token_timesteps(t, len(x), self.hidden_tokens(x.shape[2:], conditions), conditions)
        return self.run(engine or "transformer", release=release, hidden_states=x, timestep=timestep, **feeds,
                        **extra)

    def calibration_options(self, image, index: int) -> dict:
        """Wan 2.2 TI2V-5B: every other calibration clip starts from the calibration image; Wan 2.1 I2V: each."""
        c = self.constants
        image_to_video = c.get("condition_channels") or c.get("expand_timesteps") and index % 2
        return {**super().calibration_options(image, index), **({"image": image} if image_to_video else {})}

    def calibration_encode(self, output: np.ndarray) -> None:
        self.encode_video(np.ascontiguousarray(output.transpose(0, 4, 1, 2, 3)) * 2 - 1)

    def _on_grid(self, height, width) -> tuple:
        """Sides rounded down to the transformer's patches in latent pixels, with diffusers' warning."""
        multiple = self.constants["vae_scale_factor"] * self.constants["latent_multiple"]
        if not (_is_int(height) and _is_int(width)) or height % multiple == 0 and width % multiple == 0:
            return height, width
        rounded = height // multiple * multiple, width // multiple * multiple
        log.warning("height and width must be multiples of %d: (%d, %d) adjusted to (%d, %d), as diffusers does",
                    multiple, height, width, *rounded)
        return rounded

    def _conditions(self, prompts, negative_prompt, per_prompt, cfg, max_length) -> dict:
        states = self._encode(prompts, per_prompt, max_length)
        if cfg:
            states = self.guidance.batch(states, self._encode(self._negatives(prompts, negative_prompt), per_prompt,
                                                              max_length))
        return {"encoder_hidden_states": states}

    def _encode(self, prompts: list[str], per_prompt: int, max_length: int) -> np.ndarray:
        """UMT5's states of each prompt, zero past its tokens and to `max_length`, repeated for its videos."""
        encoded = encode_prompts(self, "text_encoder", "tokenizer", [prompt_clean(p) for p in prompts], max_length,
                                 post="zeroed")
        states = np.zeros((len(prompts), max_length, encoded.embeds.shape[2]), dtype=np.float32)
        states[:, :encoded.embeds.shape[1]] = encoded.embeds
        return np.repeat(states, per_prompt, axis=0)

    def _chunks(self, part: str, name: str, inputs: list[np.ndarray], what: str):
        """The outputs of the VAE `part`'s chunk graphs, chunk by chunk: the first input (fed as `name`) through
        `{part}_first`, each later one through `part` with the cache the call before returned."""
        cache = None
        for i, x in enumerate(inputs):
            feeds = {name: np.ascontiguousarray(x)}
            out = self.run(f"{part}_first", **feeds) if i == 0 else self.run(part, **feeds, cache=cache)
            cache = out["next_cache"].copy()  # fed back in: the backend may reuse its output buffers
            yield out
            self._progress(i + 1, len(inputs), what)

    def decode_video(self, latents: np.ndarray) -> np.ndarray:
        """The pipeline's latents (N, z, f, h, w) -> frames (N, F, H, W, 3) in [0, 1]: a latent frame a call (the
        first gives 1 frame, each later one 4), the output written in place as the chunks come."""
        n, _, f, h, w = latents.shape
        temporal, scale = self.constants["vae_temporal_scale"], self.constants["vae_scale_factor"]
        video = np.empty((n, 1 + (f - 1) * temporal, h * scale, w * scale, 3), dtype=np.float32)
        start = 0
        for out in self._chunks("vae_decoder", "latent", [latents[:, :, i] for i in range(f)], "decoding"):
            frames = out["frames"]
            video[:, start:start + frames.shape[2]] = np.clip(frames / 2 + 0.5, 0, 1).transpose(0, 2, 3, 4, 1)
            start += frames.shape[2]
        return video

    def encode_video(self, video: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Frames (N, 3, F, H, W) in [-1, 1], F = 4k + 1 -> the posterior (mean, log-variance), each (N, z, f, h,
        w), in the pipeline's latent space: the first frame, then 4 at a time, a latent frame a call."""
        temporal = self.constants["vae_temporal_scale"]
        frames = video.shape[2]
        if frames % temporal != 1:
            raise ValueError(f"a video of {frames} frames cannot be encoded: its frames must be {temporal}k + 1")
        parts = [video[:, :, :1]] + [video[:, :, i:i + temporal] for i in range(1, frames, temporal)]
        outs = [(o["latent_mean"].copy(), o["latent_logvar"].copy())
                for o in self._chunks("vae_encoder", "frames", parts, "encoding")]
        return tuple(np.stack(a, axis=2) for a in zip(*outs))

register_key_spelling("wan", lora_keys.to_diffusers_names)  # adapters in the original checkpoint's names
