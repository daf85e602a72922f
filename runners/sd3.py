"""Stable Diffusion 3 text-to-image, with the semantics of diffusers' StableDiffusion3Pipeline:
same prompt encoding, guidance, scheduler and VAE post-processing, so that the same weights
and the same starting latents give the same image."""
from __future__ import annotations

import numpy as np

from runners.images import to_output
from runners.pipeline import Pipeline
from runners.tiling import tiled

OUTPUT_TYPES = ("pil", "np", "latent")


class SD3Pipeline(Pipeline):
    family = "sd3"

    def generate(self, prompt, negative_prompt=None, height=None, width=None, num_inference_steps=28,
                 guidance_scale=7.0, num_images_per_prompt=1, seed=None, latents=None, output_type="pil",
                 max_sequence_length=256, vae_tiling=None):
        """Generate images (call the pipeline: `pipe(prompt, ...)`, which adds `profile=DIR`).
        `seed` seeds numpy's generator (not torch's noise: the same seed gives other images than
        diffusers); pass `latents` for exact comparison across frameworks. `vae_tiling`: see `vae_decode`."""
        c = self.constants
        missing = [n for n in self.manifest["submodules"] if n != "vae_encoder" and n not in self.sessions]
        if missing:
            raise ValueError(f"text to image needs {', '.join(missing)}, which this pipeline was loaded without "
                             "(Pipeline.load(..., submodules=...))")
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        default = c["default_image_size"]
        height, width = height or default, width or default
        cfg = guidance_scale > 1
        n_images = len(prompts) * num_images_per_prompt
        self._check(height, width, n_images * (2 if cfg else 1), output_type, max_sequence_length)
        self.timings = {}

        with self._timed("text_encoders"):
            embeds, pooled = self._encode(prompts, num_images_per_prompt, max_sequence_length)
            if cfg:
                negative = negative_prompt or ""
                negatives = len(prompts) * [negative] if isinstance(negative, str) else list(negative)
                if len(negatives) != len(prompts):
                    raise ValueError(f"negative_prompt has {len(negatives)} entries for {len(prompts)} prompts")
                neg_embeds, neg_pooled = self._encode(negatives, num_images_per_prompt, max_sequence_length)
                embeds = np.concatenate([neg_embeds, embeds])
                pooled = np.concatenate([neg_pooled, pooled])

        scale = c["vae_scale_factor"]
        shape = (n_images, c["latent_channels"], height // scale, width // scale)
        if latents is None:
            latents = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
        else:
            latents = np.asarray(latents, dtype=np.float32)
            if latents.shape != shape:
                raise ValueError(f"latents have shape {latents.shape}; this request needs {shape}")

        with self._timed("denoise"):
            mu = self.scheduler.mu_for(shape[2], shape[3], c["patch_size"])
            timesteps, sigmas = self.scheduler.timesteps(num_inference_steps, mu)
            for i, t in enumerate(timesteps):
                model_input = np.concatenate([latents, latents]) if cfg else latents
                noise = self.run("transformer", release=i == len(timesteps) - 1,
                                 hidden_states=model_input, encoder_hidden_states=embeds,
                                 pooled_projections=pooled,
                                 timestep=np.full(model_input.shape[0], t, dtype=np.float32))["noise_pred"]
                if cfg:
                    uncond, text = np.split(noise, 2)
                    noise = uncond + np.float32(guidance_scale) * (text - uncond)
                latents = self.scheduler.step(noise, sigmas[i], sigmas[i + 1], latents)
                self._progress(i + 1, len(timesteps))

        if output_type == "latent":
            return latents
        with self._timed("vae_decode"):
            z = latents / np.float32(c["vae_scaling_factor"]) + np.float32(c["vae_shift_factor"])
            image = self.vae_decode(z, tiling=vae_tiling)
        return to_output(image, output_type)

    def vae_decode(self, z: np.ndarray, tiling: bool | None = None, tile_size: int | None = None) -> np.ndarray:
        """Unscaled latents -> images in [-1, 1]. Latents larger than the decoder engine's range are
        decoded in overlapping tiles (`runners.tiling`); `tiling=True` forces it, `False` forbids
        it. `tile_size` is the tile's side in latent pixels (default: the engine's largest)."""
        lo, _, hi = self.manifest["submodules"]["vae_decoder"]["dims"]["latent_height"]
        return self._vae("vae_decoder", "latent", z, lo, hi, self.constants["vae_scale_factor"], tiling, tile_size)[0]

    def vae_encode(self, image: np.ndarray, tiling: bool | None = None, tile_size: int | None = None):
        """Images in [-1, 1] -> (mean, log-variance) of the latent posterior, tiled past the encoder
        engine's range as `vae_decode` is; `tile_size` in image pixels."""
        lo, _, hi = self.manifest["submodules"]["vae_encoder"]["dims"]["image_height"]
        return self._vae("vae_encoder", "image", image, lo, hi, 1 / self.constants["vae_scale_factor"], tiling,
                         tile_size)

    def _vae(self, name, input_name, x, lo, hi, scale, tiling, tile_size) -> list[np.ndarray]:
        if name not in self.sessions:
            raise ValueError(f"{name} is not open: the artifact has none, or the pipeline was loaded without it")
        outputs = [o["name"] for o in self.manifest["submodules"][name]["outputs"]]

        def fn(tile):  # one engine call per tile, all its outputs
            result = self.run(name, **{input_name: tile})
            return [result[o] for o in outputs]

        too_big = max(x.shape[2:]) > hi
        if tiling is False and too_big:
            raise ValueError(f"{name}: input side {max(x.shape[2:])} exceeds the engine's maximum {hi}; "
                             "allow tiling (tiling=None or True) or build the engines for a larger image size")
        if min(x.shape[2:]) < lo:
            raise ValueError(f"{name}: input side {min(x.shape[2:])} is below the engine's minimum {lo}")
        if not (tiling or too_big):
            return fn(x)
        tile = tile_size or hi
        if not lo <= tile <= hi:
            raise ValueError(f"{name}: tile_size={tile} is outside the engine's range {lo}..{hi}")
        return tiled(fn, x, tile, scale, min_side=lo)

    def _encode(self, prompts: list[str], per_prompt: int, t5_length: int):
        """diffusers' encode_prompt: penultimate CLIP-L and CLIP-G states side by side, zero-padded
        to the T5 width, then T5's states along the sequence; pooled: both CLIPs' projections."""
        c = self.constants
        hidden, pooled = [], []
        for name in ("text_encoder", "text_encoder_2"):
            tok = "tokenizer" if name == "text_encoder" else "tokenizer_2"
            out = self.run(name, input_ids=self.tokenizers[tok](prompts, c["clip_length"]))
            hidden.append(out["penultimate_hidden_states"])
            pooled.append(out["text_embeds"])
        clip = np.concatenate(hidden, axis=-1)
        width = c["joint_attention_dim"]
        clip = np.pad(clip, ((0, 0), (0, 0), (0, width - clip.shape[-1])))
        if "text_encoder_3" in self.sessions:
            ids = self.tokenizers["tokenizer_3"](prompts, t5_length)
            t5 = self.run("text_encoder_3", input_ids=ids)["last_hidden_state"]
        else:  # a pipeline saved without T5: zeros, as diffusers does
            t5 = np.zeros((len(prompts), t5_length, width), dtype=np.float32)
        embeds = np.concatenate([clip, t5], axis=1)
        pooled = np.concatenate(pooled, axis=-1)
        return np.repeat(embeds, per_prompt, axis=0), np.repeat(pooled, per_prompt, axis=0)

    def _check(self, height, width, batch, output_type, t5_length):
        multiple = self.constants["vae_scale_factor"] * self.constants["patch_size"]
        for name, value in (("height", height), ("width", width)):
            lo, _, hi = self.dims[f"image_{name}"]
            if value % multiple or not lo <= value <= hi:
                raise ValueError(f"{name}={value} is not allowed: use a multiple of {multiple} "
                                 f"from {lo} to {hi} (the range this artifact was built for)")
        lo, _, hi = self.dims["batch"]
        if batch > hi:
            raise ValueError(f"this request runs the transformer at batch {batch} (images x 2 with guidance); "
                             f"the artifact allows up to {hi}: ask for fewer images per call")
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type={output_type!r}; allowed: {', '.join(OUTPUT_TYPES)}")
        if "text_encoder_3" in self.sessions:
            lo, _, hi = self.dims["t5_length"]
            if not lo <= t5_length <= hi:
                raise ValueError(f"max_sequence_length={t5_length} is outside this artifact's range {lo}..{hi}")
