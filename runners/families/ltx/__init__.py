"""LTX-Video text and image to video, with the semantics of diffusers' LTXPipeline and LTXImageToVideoPipeline:
T5 on the prompt padded to `max_sequence_length` (unmasked; the transformer's cross-attention masks the padding),
classifier-free guidance above 1 in one batch (negative first), flow-matching Euler on sigmas 1 to 1/n shifted by
the clip's tokens, the transformer on packed latents with its positions as coordinates (frame x 8 / frame_rate,
row x 32, column x 32), and the whole clip decoded at once, after the decode noise is mixed in at `decode_timestep`.

Image to video (`image=`): the image's latent is the first latent frame, which keeps timestep 0 and is not stepped.

Where diffusers errs with several prompts or videos, this runner does what one prompt and one video would: each
video reads its own prompt's mask (diffusers pairs states p0, p0, p1, p1 with masks m0, m1, m0, m1), and the decode
timestep and noise are per video (diffusers' are per prompt, and crash with `num_videos_per_prompt > 1`).
Not ported: `guidance_rescale` (0, the default, only), `prompt_embeds`, LTX-Video 0.9.1's noise-injecting decoder
(refused at export)."""
from __future__ import annotations

import numpy as np

from runners.conditioning.images import to_model_input
from runners.guidance import ClassifierFree
from runners.latents import PER_CHANNEL, LatentLayout
from runners.options import IMAGE_TASKS, Option, options
from runners.text_to_image import TEXT, Defaults, _is_int, given_or_drawn
from runners.text_to_video import (FRAME_MASK, NUM_VIDEOS, FirstFrame, TextToVideo, first_frame_mask, frames_option,
                                   token_timesteps, video_request_options)

def video_coords(frames: int, h: int, w: int, frame_rate: float, spatial: int, temporal: int) -> np.ndarray:
    """Each token's (frame, row, column) as LTXVideoRotaryPosEmbed computes them from the integer sizes and the
    pipeline's rope_interpolation_scale (temporal / frame_rate, spatial, spatial), in float32: (3, F * h * w)."""
    f, y, x = np.meshgrid(*(np.arange(n, dtype=np.float32) for n in (frames, h, w)), indexing="ij")
    scale = np.float32(temporal / frame_rate)
    return np.stack([f * scale, y * np.float32(spatial), x * np.float32(spatial)]).reshape(3, -1)


class LTXPipeline(TextToVideo):
    family = "ltx"
    # a token a latent pixel, frame-major; latents= packed; the VAE's statistics applied here, not in its graphs
    layout = LatentLayout(video=True, packed_latents=True, normalisation=PER_CHANNEL)
    guidance = ClassifierFree()
    defaults = {TEXT: Defaults(50, 3.0)}
    options = options(
        video_request_options("512 x 704"), guidance.options,
        (frames_option(161), NUM_VIDEOS,
         Option("image", "image", "image to video: the first frame", group="image"),
         Option("frame_rate", "float", "frames per second the model is told (LTXPipeline's 25); the mp4's rate",
                default=25.0, within=lambda v: v > 0, allowed="a number > 0"),
         Option("max_sequence_length", "int", "T5 tokens of a prompt (LTXPipeline's 128)", default=128,
                within=lambda v: v >= 1, allowed="an integer >= 1"),
         Option("decode_timestep", "float", "the timestep-conditioned VAE's decode timestep (diffusers' 0.0; its "
                "docs suggest 0.05 for LTX-Video 0.9.1 and later)", default=0.0, within=lambda v: 0 <= v <= 1,
                allowed="a number in [0, 1]"),
         Option("decode_noise_scale", "float", "how much noise is mixed into the latents before decoding (default: "
                "decode_timestep)", within=lambda v: 0 <= v <= 1, allowed="a number in [0, 1]"),
         Option("decode_noise", "array", "the noise mixed in before decoding, (N, C, f, h, w) as diffusers draws it",
                cli=False),
         Option("noise", "array", "image to video: the starting noise (N, C, f, h, w) as diffusers draws it, its first "
                "frame then replaced by the image's latent", cli=False, group="image"),
         next(o for o in IMAGE_TASKS if o.name == "encoder_noise")))

    def generate(self, prompt, negative_prompt=None, image=None, height=None, width=None, num_frames=None,
                 frame_rate=25.0, num_inference_steps=None, guidance_scale=None, num_videos_per_prompt=1, seed=None,
                 latents=None, decode_timestep=0.0, decode_noise_scale=None, decode_noise=None, noise=None,
                 encoder_noise=None,
                 output_type="np", max_sequence_length=128):
        """Generate videos (call the pipeline: `pipe(prompt, ...)`). `latents` as LTXPipeline takes them, packed:
        (N, f * h * w, C) for f = (num_frames - 1) / 8 + 1 latent frames of height / 32 x width / 32. With `image`,
        the video starts from it (LTXImageToVideoPipeline; with `latents` given, their first frame is kept, as
        diffusers keeps it)."""
        c = self.constants
        prompts, steps, guidance_scale, num_frames = self._video_request(prompt, num_inference_steps, guidance_scale,
                                                                         output_type, num_frames)
        height = c["default_height"] if height is None else height
        width = c["default_width"] if width is None else width
        lo, _, hi = self.dims["text_length"]
        if not _is_int(max_sequence_length) or not lo <= max_sequence_length <= hi:
            raise ValueError(f"max_sequence_length={max_sequence_length} is outside this artifact's range {lo}..{hi}")
        n_videos = len(prompts) * num_videos_per_prompt
        cfg = self.guidance.on(guidance_scale)
        self._check(height, width, n_videos * (2 if cfg else 1), "np")
        rng = np.random.default_rng(seed)
        scale, temporal = c["vae_scale_factor"], c["vae_temporal_scale"]
        shape = self.layout.shape(self, n_videos, height, width, num_frames)
        first = None
        if latents is not None:
            latents = given_or_drawn("latents", self.layout.from_diffusers(latents, shape, "LTXPipeline"), shape, rng)
            first = latents[:, :, :1] if image is not None else None
        elif image is not None:
            with self._timed("vae_encode"):
                first = self._image_latent(image, len(prompts), num_videos_per_prompt, height, width, encoder_noise,
                                           rng)
        with self._timed("text_encoders"):
            conditions = self._conditions(prompts, negative_prompt, num_videos_per_prompt, cfg, max_sequence_length)
        if latents is None:
            latents = given_or_drawn("noise", noise, shape, rng).copy()
            if first is not None:
                latents[:, :, :1] = first
        rows = n_videos * (2 if cfg else 1)
        conditions["video_coords"] = np.broadcast_to(
            video_coords(*shape[2:], frame_rate, scale, temporal), (rows, 3, int(np.prod(shape[2:])))).copy()
        hook = None
        if first is not None:
            conditions[FRAME_MASK] = first_frame_mask(rows, shape[2], shape[3] * shape[4])
            hook = FirstFrame(first)
        schedule = self._schedule(steps, shape)
        with self._timed("denoise"):
            latents = self._denoise(latents, schedule, guidance_scale, conditions, inpainting=hook)
        if output_type == "latent":
            return self.layout.as_diffusers(latents)
        with self._timed("vae_decode"):
            noise_scale = decode_timestep if decode_noise_scale is None else decode_noise_scale
            video = self.decode_video(latents, decode_timestep, noise_scale, decode_noise, rng)
            return self._frames_output(video, output_type)

    def _predict(self, x, t, conditions: dict, release: bool, engine: str | None = None, **extra) -> dict:
        """One transformer call on 5-D latents: packed in, a timestep per token (0 on the first frame's for image to
        video), the prediction unpacked."""
        n, _, f, h, w = x.shape
        feeds, timestep = token_timesteps(t, n, self.layout.tokens((f, h, w)), conditions)
        out = self.run(engine or "transformer", release=release, hidden_states=self.layout.pack(x), timestep=timestep,
                       **feeds, **extra)
        if "noise_pred" in out:
            out = {**out, "noise_pred": self.layout.unpack(out["noise_pred"], (f, h, w))}
        return out

    def calibration_options(self, image, index: int) -> dict:
        """Every other calibration clip starts from the calibration image (image to video's timesteps per token)."""
        return {**super().calibration_options(image, index), **({"image": image} if index % 2 else {})}

    def calibration_encode(self, output: np.ndarray) -> None:
        """Calibration: the VAE encoder on a clip's first frame, as image to video runs it."""
        self.run("vae_encoder", image=np.ascontiguousarray(output[:, 0].transpose(0, 3, 1, 2)) * 2 - 1)

    def _conditions(self, prompts, negative_prompt, per_prompt, cfg, max_length) -> dict:
        states, mask = self._encode(prompts, per_prompt, max_length)
        if cfg:
            negative, negative_mask = self._encode(self._negatives(prompts, negative_prompt), per_prompt, max_length)
            states, mask = self.guidance.batch(states, negative), self.guidance.batch(mask, negative_mask)
        return {"encoder_hidden_states": states, "encoder_attention_mask": mask}

    def _encode(self, prompts: list[str], per_prompt: int, max_length: int) -> tuple[np.ndarray, np.ndarray]:
        """T5's states of the prompts padded to `max_length` (the padding's read too) and their masks, each repeated
        for its prompt's videos."""
        tokens = self.tokenizers["tokenizer"].encode(prompts, max_length, padding="max_length")
        states = self.run("text_encoder", input_ids=tokens.ids)["last_hidden_state"]
        return np.repeat(states, per_prompt, axis=0), np.repeat(tokens.mask, per_prompt, axis=0)

    def _image_latent(self, image, n_prompts, per_prompt, height, width, encoder_noise, rng) -> np.ndarray:
        """The first frame's latent (N, C, 1, h, w) of one image, or one per prompt: the VAE's posterior sampled
        with `encoder_noise` (one draw per image, as diffusers samples it) and normalised by the VAE's statistics."""
        pixels = to_model_input(image, height, width, multiple=self.constants["vae_scale_factor"])
        if len(pixels) not in (1, n_prompts):
            raise ValueError(f"{len(pixels)} images for {n_prompts} prompts: give one, or one per prompt")
        out = self.run("vae_encoder", image=pixels)
        mean, logvar = out["latent_mean"], out["latent_logvar"]
        noise = given_or_drawn("encoder_noise", encoder_noise, (len(pixels), mean.shape[1], 1, *mean.shape[2:]), rng)
        sample = mean[:, :, None] + np.exp(np.float32(0.5) * logvar[:, :, None]) * noise
        latent = self.layout.normalisation.from_vae(self, sample)  # diffusers' _normalize_latents
        return np.repeat(np.broadcast_to(latent, (n_prompts, *latent.shape[1:])), per_prompt, axis=0)

    def decode_video(self, latents, decode_timestep: float, noise_scale: float, decode_noise, rng) -> np.ndarray:
        """The pipeline's latents (N, C, f, h, w) -> frames (N, F, H, W, 3) in [0, 1]: denormalised, the decode
        noise mixed in (a timestep-conditioned VAE's; each video's, where diffusers draws per prompt) and the clip
        decoded at once."""
        z = self.layout.normalisation.to_vae(self, latents)
        if self.constants["vae_timestep_conditioning"]:
            noise = given_or_drawn("decode_noise", decode_noise, z.shape, rng)
            s = np.float32(noise_scale)
            z = (np.float32(1) - s) * z + s * noise
        frames = self.run("vae_decoder", latent=np.ascontiguousarray(z, dtype=np.float32),
                          timestep=np.full(len(z), decode_timestep, dtype=np.float32))["frames"]
        return np.clip(frames / 2 + 0.5, 0, 1).transpose(0, 2, 3, 4, 1)
