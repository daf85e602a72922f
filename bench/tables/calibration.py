"""The calibration table (issue 54's): how a calibrated precision's image (OpenVINO int8 by default) changes with
the calibration's prompts, steps and size, against what each setting costs to record, so that the default a build
uses is one a user can wait for. Each setting builds the artifact in a folder of its own beside the model's build
(they share its export, fp32 artifact and recordings); the images are compared with ort-fp32's as the precision
table compares them (the same prompts and starting latents)."""
from __future__ import annotations

import json
from pathlib import Path

from bench import accuracy
from bench.harness import in_child, in_prepared_child
from bench.prepare import sibling_build
from bench.tables import Table
from engines.calibration import CalibrationSettings


def _setting(text: str) -> dict:
    """A --calibration-grid entry, "PROMPTSxSTEPS@SIZE" ("@default": engines' own size, CalibrationSettings.side;
    "default" alone: what engines records with no calibration option)."""
    if text == "default":
        text = f"{CalibrationSettings.prompts}x{CalibrationSettings.steps}@default"
    counts, _, size = text.partition("@")
    prompts, _, steps = counts.partition("x")
    try:
        return {"prompts": int(prompts), "steps": int(steps), "size": None if size in ("", "default") else int(size)}
    except ValueError:
        raise ValueError(f"--calibration-grid entry {text!r}: write PROMPTSxSTEPS@SIZE, e.g. 8x4@512 or 32x8@default")


def _label(setting: dict) -> str:
    return f"{setting['prompts']} x {setting['steps']} at {setting['size'] or 'default'}"


def _build(build: Path, settings: list[dict], target: str, precision: str) -> dict[str, str]:
    """{label: artifact folder} of each setting's build."""
    from engines.api import build_artifact
    from engines.calibration import CalibrationSettings

    return {_label(s): str(build_artifact(sibling_build(build, f"calibrated-{s['prompts']}x{s['steps']}-"
                                                         f"{s['size'] or 'default'}"),
                                          target, precision, calibration=CalibrationSettings(**s)))
            for s in settings}


def _costs(folder: str) -> tuple[dict, float, float | None]:
    """(the recording's settings, the build's seconds without it, the recording's seconds: None where an earlier
    version made it without timing it) of an artifact, from its manifest."""
    manifest = json.loads((Path(folder) / "manifest.json").read_text())
    recording = manifest["calibration"]
    return (recording["settings"], sum(e["build_seconds"] for e in manifest["submodules"].values()),
            recording.get("seconds"))


def measure(run) -> list[dict]:
    a = run.args
    settings = [_setting(s) for s in a.calibration_grid.split(",")]
    target, precision = a.calibration_artifact.rsplit("-", 1)
    built = in_prepared_child(_build, run.build, settings, target, precision)
    errors = in_child(accuracy.accuracy, str(run.default_artifact), built, run.constants, run.denoiser, a.size,
                      a.precision_steps)
    first = errors[next(iter(built))]["psnr_min"]
    rows = []
    for label, folder in built.items():
        recorded, build_seconds, seconds = _costs(folder)
        err = errors[label]
        rows.append([label, f"{recorded['size']}x{recorded['size']}", str(recorded["prompts"] * recorded["steps"]),
                     "-" if seconds is None else f"{seconds:.0f}", f"{build_seconds:.0f}",
                     *accuracy.accuracy_cells(err)[:3], f"{err['psnr_min'] - first:+.1f}"])
    cheapest = min((r for r in rows if r[3] != "-" and float(r[-1]) >= -0.5), key=lambda r: float(r[3]),
                   default=None)
    timesteps = ", ".join(errors[next(iter(built))]["denoiser_rel_err"])
    return [{
        "reps": 1,
        "title": f"Calibration settings of {a.calibration_artifact} on {run.src.entry.name}: recording time against "
                 f"the image's error (images at {a.size}x{a.size}, {a.precision_steps} steps)",
        "columns": ["calibration (prompts x steps at size)", "recorded at", "denoiser steps recorded",
                    "recording s", "quantize and compile s", "image PSNR dB vs ort-fp32 (worst of 4)",
                    "image max abs", f"{run.denoiser} rel. err at t = {timesteps}", "PSNR vs the first row dB"],
        "rows": rows,
        "notes": ["Each setting records the fp32 artifact on its prompts (prompt i with seed i, guidance 7) at its "
                  "steps and size, then builds the artifact from that recording; the recording's seconds are those "
                  "of the run that made it (one process, the model's 2 cores). Errors as in the precision table: "
                  "the same 4 prompts (none of them a calibration prompt) and starting latents.",
                  "The cheapest setting within 0.5 dB of the first row's PSNR: "
                  + (f"{cheapest[0]} ({cheapest[3]} s of recording)." if cheapest else "none timed.")]}]


def _arguments(group) -> None:
    group.add_argument("--calibration-grid", default="32x8@512,16x4@512,8x4@512,8x4@256,4x8@256,4x2@256",
                       help="comma-separated calibration settings of the calibration table, PROMPTSxSTEPS@SIZE "
                            "(@default: what engines records at when no size is named; 'default': engines' whole "
                            "default); the first is the reference of its last column")
    group.add_argument("--calibration-artifact", default="openvino-int8",
                       help="the calibrated artifact the calibration table builds per setting: openvino-int8, "
                            "ort-fp8 or ort-fp16")


TABLE = Table("calibration", "Calibration settings of", "the calibrated artifact once per calibration setting",
              ("sd3", "flux", "sd15"), measure, _arguments,  # sd15-bench: a real-size model's cost
              # one setting: engines' default counts at the tiny model's 128x128 (the tests' own recording)
              smoke=("--precision-steps", "1", "--calibration-artifact", "ort-fp16",
                     "--calibration-grid", f"{CalibrationSettings.prompts}x{CalibrationSettings.steps}@128"))
