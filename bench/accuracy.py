"""The error of built artifacts against the fp32 artifact, on the same prompts and starting
latents: what the precision and openvino tables report beside their timings. `accuracy` runs in
a child process of `python -m bench` (functions sent to a child must live in an importable module)."""
from __future__ import annotations

import numpy as np

from bench.harness import in_child, in_prepared_child
from engines.calibration import LARGEST_DEFAULT_SIZE, CalibrationSettings

PROMPTS = ("a photo of an astronaut riding a horse on the moon, detailed, golden light",
           "a red fox in fresh snow, telephoto", "a bowl of ramen with a soft-boiled egg", "")


def psnr(reference: np.ndarray, image: np.ndarray) -> float:
    """Of images in [0, 1]."""
    return float(10 * np.log10(1 / np.mean((reference.astype(np.float64) - image) ** 2)))


def _output(outputs: dict) -> np.ndarray:
    return next(iter(outputs.values()))  # a denoiser has one output


def accuracy(reference: str, artifacts: dict[str, str], constants: dict, denoiser: str, size: int,
             steps: int) -> dict[str, dict]:
    """Per artifact ({label: folder}): image PSNR (worst prompt) and max abs error against the
    `reference` artifact (fp32), the denoiser output's relative error at the first, middle and
    last step, and whether all stayed finite (for the reference itself, under "reference", only the last)."""
    from bench.workload import start_latents
    from runners import Pipeline

    latents = start_latents(constants, size, size)
    checked = sorted({0, steps // 2, steps - 1})
    feeds = []  # the fp32 denoiser's inputs at every step of the first prompt

    def record(submodule, call):
        if submodule == denoiser and len(feeds) < steps:
            feeds.append(dict(call))

    def images(pipe):
        return [pipe(p, height=size, width=size, num_inference_steps=steps, latents=pipe.layout.as_diffusers(latents),
                     output_type="np") for p in PROMPTS]

    ref = Pipeline.load(reference, verify=False)
    ref.recorder = record
    ref_images = images(ref)
    ref.recorder = None
    steps_feeds = [feeds[i] for i in checked]
    ref_noise = [_output(ref.run(denoiser, **f)) for f in steps_feeds]
    del ref
    results = {"reference": {"finite": bool(all(np.isfinite(x).all() for x in ref_images + ref_noise))}}
    for label, folder in artifacts.items():
        pipe = Pipeline.load(folder, verify=False)
        got = images(pipe)
        noise = [_output(pipe.run(denoiser, **f)) for f in steps_feeds]
        del pipe
        results[label] = {
            "psnr_min": min(psnr(a, b) for a, b in zip(ref_images, got)),
            "max_abs": max(float(np.abs(a - b).max()) for a, b in zip(ref_images, got)),
            "denoiser_rel_err": {f"{f['timestep'][0]:.0f}": float(np.linalg.norm(n - r) / np.linalg.norm(r))
                                 for f, n, r in zip(steps_feeds, noise, ref_noise)},
            "finite": bool(all(np.isfinite(x).all() for x in got + noise)),
        }
    return results


def calibration(args) -> dict:
    """The calibration settings (engines.calibration.CalibrationSettings' fields) of every table's
    calibrated builds: the same settings, so an artifact two tables need is built once."""
    return {"prompts": args.calibration_prompts, "steps": args.calibration_steps, "size": args.calibration_size}


def calibration_text(args) -> str:
    return (f"{args.calibration_prompts} prompts x {args.calibration_steps} steps at "
            f"{args.calibration_size}x{args.calibration_size}")


def built_and_checked(run, build, *args) -> tuple[dict[str, str], dict[str, dict]]:
    """The artifacts `build(build_dir, calibration settings, *args)` makes ({label: folder}, in a
    child process), and their error against the default artifact (`accuracy`)."""
    a = run.args
    built = in_prepared_child(build, run.build, calibration(a), *args)
    return built, in_child(accuracy, str(run.default_artifact), built, run.constants, run.denoiser, a.size,
                           a.precision_steps)


def accuracy_cells(err: dict) -> list[str]:
    """Image PSNR, image max abs, denoiser rel. errors, all finite: of one variant's entry in
    `accuracy`'s result ({} for a variant it did not run)."""
    cells = ["-"] * 3 + [("yes" if err["finite"] else "NO") if err else "-"]
    if "psnr_min" in err:
        cells[:3] = [f"{err['psnr_min']:.1f}", f"{err['max_abs']:.1e}",
                     ", ".join(f"{e:.1e}" for e in err["denoiser_rel_err"].values()) or "-"]
    elif err:
        cells[0] = "reference"
    return cells


def add_arguments(parser) -> None:
    """The options of the error measurements and calibration, which the precision and openvino tables share."""
    group = parser.add_argument_group("error and calibration (precision, openvino)")
    group.add_argument("--precision-steps", type=int, default=4,
                       help="steps of the end-to-end runs whose images are compared with the fp32 artifact's")
    group.add_argument("--calibration-size", type=int, default=LARGEST_DEFAULT_SIZE,
                       help="image side of the fp16/fp8/int8 calibration run")
    group.add_argument("--calibration-steps", type=int, default=CalibrationSettings.steps,
                       help="denoising steps per calibration prompt")
    group.add_argument("--calibration-prompts", type=int, default=CalibrationSettings.prompts,
                       help="prompts of the calibration run")


# The smoke test's: one step, and the calibration the tests' builds use (engines.calibration's defaults at
# the tiny models' 128x128), so that its calibrated artifacts are the ones the tests built before it.
SMOKE = ("--precision-steps", "1", "--calibration-size", "128", "--calibration-steps", str(CalibrationSettings.steps),
         "--calibration-prompts", str(CalibrationSettings.prompts))
# The LLM-encoder families' tests build their targets on a shorter calibration (tests/conftest.py's
# assert_targets_within, at the tiny models' 128x128): their tables' smoke (bench/tables/family_table.py) takes it,
# so that its openvino-int8 artifact is the one those tests built.
FAMILY_TESTS_CALIBRATION = CalibrationSettings(prompts=4, steps=4)
FAMILY_SMOKE = (*SMOKE, "--calibration-steps", str(FAMILY_TESTS_CALIBRATION.steps))
