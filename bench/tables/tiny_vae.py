"""The tiny autoencoder table: one VAE decode at --size through the model's VAE and through the tiny
autoencoder exported beside it (`python -m export MODEL --tiny-vae ...`), in one ort-fp32 artifact,
against diffusers' AutoencoderKL and AutoencoderTiny eager; and what a live preview costs a step,
through the tiny decoder and through the latent-to-RGB map of an artifact without one.

The tiny autoencoder is a random AutoencoderTiny at the architecture of the family's madebyollin model
(export/families/tiny_vae.py: its "-bench" entries; "-tiny" ones for the tiny test models): the
time of a decode does not depend on the weights."""
from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from bench.harness import in_child, in_prepared_child, log, timed_calls
from bench.prepare import build_with_tiny_vae, tiny_vae_name
from bench.tables import Table
from bench.workload import PROMPT


def _latent(channels: int, size: int) -> np.ndarray:
    """The one latent every decoder of the table decodes: `size` pixels square, batch 1."""
    return np.random.default_rng(0).standard_normal((1, channels, size // 8, size // 8)).astype(np.float32)


def _decodes(artifact: str, channels: int, size: int, reps: int) -> dict[str, list[float]]:
    """Seconds of `reps` calls of each decoder of `artifact` on one latent of `size` pixels, interleaved."""
    from runners import Pipeline

    latent = _latent(channels, size)
    with Pipeline.load(artifact, submodules=["vae_decoder", "vae_decoder_tiny"]) as pipe:
        return timed_calls({name: lambda name=name: pipe.run(name, latent=latent)
                            for name in ("vae_decoder", "vae_decoder_tiny")}, reps)


def _diffusers_decodes(folder: str, tiny_folder: str, channels: int, size: int, reps: int) -> dict[str, list[float]]:
    """The same for diffusers' AutoencoderKL (the model's VAE) and AutoencoderTiny, eager fp32."""
    import diffusers
    import torch
    from diffusers import AutoencoderKL, AutoencoderTiny

    torch.set_grad_enabled(False)
    diffusers.utils.logging.set_verbosity_error()  # random configs' notices
    latent = torch.from_numpy(_latent(channels, size))
    vaes = {"AutoencoderKL": AutoencoderKL.from_pretrained(Path(folder) / "vae").eval(),
            "AutoencoderTiny": AutoencoderTiny.from_pretrained(tiny_folder).eval()}
    return timed_calls({name: lambda vae=vae: vae.decode(latent) for name, vae in vaes.items()}, reps)


def _preview_cost(artifact: str, size: int, steps: int) -> dict[str, float]:
    """One image of `steps` steps with a preview after every step: the seconds of the previews and of
    the denoising loop, per step."""
    from runners import Pipeline

    with Pipeline.load(artifact) as pipe:
        pipe(PROMPT, height=size, width=size, num_inference_steps=1, seed=0, output_type="np")  # warm-up
        pipe.timings.clear()
        pipe(PROMPT, height=size, width=size, num_inference_steps=steps, seed=0, output_type="np",
             preview_every=1, on_preview=lambda step, images: None)
        previews = pipe.timings["previews"]
        return {"preview": previews / steps, "step": (pipe.timings["denoise"] - previews) / steps}


def measure(run) -> list[dict]:
    from export.families.tiny_vae import COMPONENT, tiny_vae_source

    a, size, channels = run.args, run.args.size, run.constants["latent_channels"]
    tiny = tiny_vae_name(run)
    log(f"tiny-vae: {run.src.entry.name} with {tiny}")
    artifact = str(in_prepared_child(build_with_tiny_vae, run.src.entry.name, run.build, tiny) / "ort-fp32")
    ours = in_child(_decodes, artifact, channels, size, a.tiny_vae_reps)
    theirs = in_child(_diffusers_decodes, str(run.src.folder), str(tiny_vae_source(tiny, channels).folder / COMPONENT),
                      channels, size, a.tiny_vae_reps)
    previews = {"the tiny decoder": in_child(_preview_cost, artifact, size, a.tiny_vae_steps),
                "the latent-to-RGB map (no tiny decoder)": in_child(_preview_cost, str(run.default_artifact), size,
                                                                     a.tiny_vae_steps)}
    med = statistics.median
    rows = []
    for label, (full, small) in (("ours ort-fp32", (ours["vae_decoder"], ours["vae_decoder_tiny"])),
                                 ("diffusers eager fp32", (theirs["AutoencoderKL"], theirs["AutoencoderTiny"]))):
        ratios = [f / s for f, s in zip(full, small)]
        rows.append([label, f"{med(full) * 1e3:.1f}", f"{med(small) * 1e3:.1f}",
                     f"{med(ratios):.1f}x [{min(ratios):.1f}-{max(ratios):.1f}]"])
    said = [f"through {how}: {p['preview'] * 1e3:.1f} ms, {p['preview'] / p['step']:.1%} of a step's "
            f"{p['step']:.2f} s" for how, p in previews.items()]
    return [{
        "reps": a.tiny_vae_reps,
        "title": f"Tiny autoencoder on {run.src.entry.name} at {size}x{size}: one VAE decode, full and tiny, and what "
                 "a live preview costs",
        "columns": ["decoder", "VAE decode ms", "tiny decode ms", "speed-up of the tiny decode [min-max]"],
        "rows": rows,
        "notes": [f"Medians of {a.tiny_vae_reps} calls of each decoder on the same latent (batch 1), after a "
                  "warm-up, the two alternating in one process (ours in one, diffusers' in another). Ours: the "
                  f"model's export with the tiny autoencoder {tiny} beside its VAE (`python -m export "
                  f"{run.src.entry.name} --tiny-vae {tiny}`), built for ort-fp32, both decoders in one artifact. "
                  "The tiny autoencoder is a random AutoencoderTiny at the architecture of madebyollin's one for "
                  "this family (its decode time does not depend on the weights). The goal of issue 35: the tiny "
                  "decode at least 10x faster.",
                  f"A live preview (`preview_every=1`), in a {a.tiny_vae_steps}-step ort-fp32 image after a "
                  f"1-step warm-up: {'; '.join(said)} (`timings[\"previews\"]` against the rest of "
                  "`timings[\"denoise\"]`)."]}]


def _arguments(group) -> None:
    group.add_argument("--tiny-vae-reps", type=int, default=10, help="calls of each decoder in the tiny-vae table")
    group.add_argument("--tiny-vae-steps", type=int, default=4, help="steps of the tiny-vae table's preview runs")


TABLE = Table("tiny-vae", "Tiny autoencoder", "the export with a random tiny autoencoder, for ort-fp32",
              ("sd3", "flux", "sd15", "sdxl"), measure, _arguments,
              smoke=("--tiny-vae-reps", "2", "--tiny-vae-steps", "1"))
