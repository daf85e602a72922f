"""The precision table's two halves that are not timing: building the artifacts of each precision
(calibrated on the fp32 pipeline), and their error against the fp32 artifact on the same prompts
and starting latents. Both run in a child process of `python -m bench` (functions sent to a
child must live in an importable module)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

PRECISIONS = ("fp16", "int8", "fp8")
PROMPTS = ("a photo of an astronaut riding a horse on the moon, detailed, golden light",
           "a red fox in fresh snow, telephoto", "a bowl of ramen with a soft-boiled egg", "")


def build_precisions(build: Path, calibration: dict) -> dict[str, str]:
    from engines.api import build_artifact
    from engines.calibration import CalibrationSettings

    settings = CalibrationSettings(**calibration)
    return {p: str(build_artifact(build, "ort", p, calibration=settings)) for p in PRECISIONS}


def accuracy(reference: str, artifacts: dict[str, str], constants: dict, size: int, steps: int) -> dict[str, dict]:
    """Per artifact ({label: folder}): image PSNR (worst prompt) and max abs error against the
    `reference` artifact (fp32), the transformer output's relative error at the first, middle and
    last step, and whether all stayed finite (for the reference itself, under "reference", only the last)."""
    from bench.variants import start_latents
    from runners import Pipeline

    latents = start_latents(constants, size, size)
    checked = sorted({0, steps // 2, steps - 1})
    feeds = []  # the fp32 transformer's inputs at the checked steps of the first prompt

    def record(submodule, call):
        if submodule == "transformer" and len(feeds) < steps:
            feeds.append(dict(call))

    def images(pipe):
        return [pipe(p, height=size, width=size, num_inference_steps=steps, latents=latents, output_type="np")
                for p in PROMPTS]

    ref = Pipeline.load(reference, verify=False)
    ref.recorder = record
    ref_images = images(ref)
    ref.recorder = None
    steps_feeds = [feeds[i] for i in checked]
    ref_noise = [ref.run("transformer", **f)["noise_pred"] for f in steps_feeds]
    del ref
    results = {"reference": {"finite": bool(all(np.isfinite(x).all() for x in ref_images + ref_noise))}}
    for label, folder in artifacts.items():
        pipe = Pipeline.load(folder, verify=False)
        got = images(pipe)
        noise = [pipe.run("transformer", **f)["noise_pred"] for f in steps_feeds]
        del pipe
        results[label] = {
            "psnr_min": min(psnr(a, b) for a, b in zip(ref_images, got)),
            "max_abs": max(float(np.abs(a - b).max()) for a, b in zip(ref_images, got)),
            "transformer_rel_err": {f"{f['timestep'][0]:.0f}": float(np.linalg.norm(n - r) / np.linalg.norm(r))
                                    for f, n, r in zip(steps_feeds, noise, ref_noise)},
            "finite": bool(all(np.isfinite(x).all() for x in got + noise)),
        }
    return results


def psnr(reference: np.ndarray, image: np.ndarray) -> float:
    """Of images in [0, 1]."""
    return float(10 * np.log10(1 / np.mean((reference.astype(np.float64) - image) ** 2)))
