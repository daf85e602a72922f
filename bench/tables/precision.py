"""Each precision ONNX Runtime's CPU runs (fp16, int8, fp8, calibrated on the fp32 pipeline):
the denoiser step and a whole run against diffusers eager fp32, and the error of its images and
denoiser output against the fp32 artifact. The builds run in a child process of `python -m bench`
(functions sent to a child must live in an importable module)."""
from __future__ import annotations

from pathlib import Path

from bench import accuracy
from bench.harness import Variant, against_first, interleaved_fresh, log
from bench.tables import Table

PRECISIONS = ("fp16", "int8", "fp8")


def build_precisions(build: Path, calibration: dict, precisions: list[str]) -> dict[str, str]:
    from engines.api import build_artifact
    from engines.calibration import CalibrationSettings

    settings = CalibrationSettings(**calibration)
    return {p: str(build_artifact(build, "ort", p, calibration=settings)) for p in precisions}


def measure(run) -> list[dict]:
    a, name = run.args, run.denoiser
    precisions = a.precisions.split(",")
    unknown = set(precisions) - set(PRECISIONS)
    if unknown:
        raise ValueError(f"precision table: no precision {', '.join(sorted(unknown))}; choose from {', '.join(PRECISIONS)}")
    built, errors = accuracy.built_and_checked(run, build_precisions, precisions)
    artifacts = {"reference": str(run.default_artifact), **built}
    variants = [run.variants[0]] + [Variant(f"ours {Path(path).name}", "ours", path) for path in artifacts.values()]
    precision_of = {v.label: p for v, p in zip(variants[1:], artifacts)}
    step = {"job": "submodules", "inputs": run.inputs(a.size, [name]), "calls": 3, "height": a.size, "width": a.size}
    e2e = {"job": "e2e", "steps": a.precision_steps, "height": a.size, "width": a.size}
    samples, peaks, failed = interleaved_fresh(variants, run.constants, [step, e2e], a.reps, log, warmup=True)
    if failed:
        raise RuntimeError(f"precision table: {'; '.join(failed.values())}")
    steps = against_first(variants, samples, lambda s: s[0][name])
    runs = against_first(variants, samples, lambda s: s[1]["seconds"])
    rows = []
    for (v, st, ratio), (_, e2e_st, e2e_ratio) in zip(steps, runs):
        rows.append([v.label, f"{st.median * 1e3:.0f}", ratio, f"{e2e_st.median:.1f}", e2e_ratio,
                     *accuracy.accuracy_cells(errors.get(precision_of.get(v.label), {})), f"{peaks[v.label]:.0f}"])
    timesteps = ", ".join(errors[precisions[0]]["denoiser_rel_err"])
    return [{
        "title": f"Precision at {a.size}x{a.size}: {name} step (batch 2) and end to end ({a.precision_steps} "
                 "steps), error against ort-fp32",
        "columns": ["variant", "step ms", "step speed-up vs (a)", "end to end s", "speed-up vs (a)",
                    "image PSNR dB (worst of 4)", "image max abs", f"{name} rel. err at t = {timesteps}",
                    "all finite", "peak RSS MiB"],
        "rows": rows,
        "notes": [f"Each repetition runs every variant in a fresh process: one untimed warm-up of both jobs, then "
                  f"the median of three {name} calls and one end-to-end run. Errors: {len(accuracy.PROMPTS)} "
                  f"prompts (one empty), the same starting latents, images in [0, 1] against the ort-fp32 artifact's; "
                  f"the {name}'s relative error is on the fp32 pipeline's own inputs at the first, middle and last "
                  f"step. fp16 and fp8 are calibrated on {accuracy.calibration_text(a)} (`python -m engines "
                  f"--precision P --calibration-prompts {a.calibration_prompts} --calibration-size "
                  f"{a.calibration_size} --calibration-steps {a.calibration_steps}`). ONNX Runtime's CPU kernels run fp16 and fp8 as a simulation of the GPU "
                  "numerics, mostly by casting to fp32, so their speed here says nothing about a GPU's."]}]


# Its speed reference is diffusers' StableDiffusion3Pipeline (bench.variants.Diffusers).
def _arguments(group) -> None:
    group.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated precisions of the "
                       "precision table (int8 is the openvino table's int8 reference too: built once for both)")


TABLE = Table("precision", "Precision at", "ort fp16, int8 and fp8 (calibrated)", ("sd3",), measure, _arguments,
              smoke=(*accuracy.SMOKE, "--precisions", "int8"))
