"""The OpenVINO table's builds, run in a child process of `python -m bench`: our ort-int8 and
openvino-fp32/-bf16/-int8 artifacts beside the default ort-fp32 one, and the steps from plain
OpenVINO to our default, each one change on top of the previous:
- openvino-bf16 without our passes, dynamic shapes: plain OpenVINO on our export;
- with our passes (what the passes add), then the default per-size shapes (what static shapes add);
- openvino-int8 with dynamic shapes, then per-size (int8 alone, and shapes on top of it);
- openvino-int8 compiled for the CPU at build time for the table's size (`--ov-device CPU
  --ov-sizes`: static shapes built for a list of sizes, and the ahead-of-time load).

Every variant is built through the same API. Plain OpenVINO's is built into a sibling build folder (bench.prepare) whose
export, fp32 artifact and calibration are links to this one's: the same graphs and recordings, but a folder
of its own (an artifact's name says its target, precision and options, not its passes).
"""
from __future__ import annotations

import statistics
from pathlib import Path

from bench import accuracy
from bench.harness import Variant, against_first, interleaved_fresh, log, running
from bench.prepare import sibling_build
from bench.tables import Table


def build_openvino(build: Path, calibration: dict, size: int, only: list[str] | None = None) -> dict[str, str]:
    """{artifact label: folder} (`only`: those labels); every build is cached like `python -m engines`."""
    from engines.api import build_artifact
    from engines.calibration import CalibrationSettings
    from engines.targets.openvino import OpenVinoOptions

    settings = CalibrationSettings(**calibration)
    dynamic = OpenVinoOptions(shapes="dynamic")
    builds = {"ort-int8": lambda: build_artifact(build, "ort", "int8"),
              "openvino-fp32": lambda: build_artifact(build, "openvino", "fp32"),
              "openvino-bf16, no passes, dynamic shapes": lambda: build_artifact(
                  sibling_build(build, "no-passes"), "openvino", "bf16", passes=[], options=dynamic),
              "openvino-bf16, dynamic shapes": lambda: build_artifact(build, "openvino", "bf16", options=dynamic),
              "openvino-bf16": lambda: build_artifact(build, "openvino", "bf16"),
              # What a full-size model's run fits in (sd3-fullsize: its T5's bf16 weights take 14 GiB compiled)
              "openvino-bf16-int8-weights": lambda: build_artifact(build, "openvino", "bf16",
                                                                   options=OpenVinoOptions(weights="int8")),
              "openvino-bf16-int4-weights": lambda: build_artifact(build, "openvino", "bf16",
                                                                   options=OpenVinoOptions(weights="int4")),
              "openvino-int8, dynamic shapes": lambda: build_artifact(build, "openvino", "int8", calibration=settings,
                                                                      options=dynamic),
              "openvino-int8": lambda: build_artifact(build, "openvino", "int8", calibration=settings),
              f"openvino-int8, compiled for CPU at {size}x{size}": lambda: build_artifact(
                  build, "openvino", "int8", calibration=settings, options=OpenVinoOptions(device="CPU",
                                                                                           sizes=((size, size),)))}
    unknown = set(only or ()) - set(builds)
    if unknown:
        raise ValueError(f"openvino table: no variant {', '.join(sorted(unknown))}; they are: {', '.join(builds)}")
    return {label: str(make()) for label, make in builds.items() if only is None or label in only}


def _peer_error(run, reference: Variant, peer: Variant) -> dict:
    """The peer's images against the reference artifact's, both made in their own worker process
    from the same prompts and starting latents (the denoiser's error is ours only)."""
    import tempfile

    import numpy as np

    with tempfile.TemporaryDirectory() as out, running([reference, peer], run.constants, log) as workers:
        job = {"job": "images", "prompts": list(accuracy.PROMPTS), "steps": run.args.precision_steps,
               "height": run.args.size, "width": run.args.size}
        files = [w.ask({**job, "out": str(Path(out) / str(i))})["files"] for i, w in enumerate(workers)]
        pairs = [(np.load(r), np.load(p)) for r, p in zip(*files)]
    return {"psnr_min": min(accuracy.psnr(r, p) for r, p in pairs),
            "max_abs": max(float(np.abs(r - p).max()) for r, p in pairs),
            "denoiser_rel_err": {}, "finite": bool(all(np.isfinite(p).all() for _, p in pairs))}


def measure(run) -> list[dict]:
    """Our CPU artifacts (ONNX Runtime and OpenVINO, each precision) against diffusers eager and
    optimum-intel: the denoiser step, the VAE decode and a whole run, load and first-call time,
    peak RSS, and the error against the ort-fp32 artifact."""
    a, name = run.args, run.denoiser
    # ort-int8 is the int8 reference of the table's error column: always there
    only = ["ort-int8", *a.openvino_variants.split(",")] if a.openvino_variants else None
    built, errors = accuracy.built_and_checked(run, build_openvino, a.size, only)
    variants = [run.variants[0], Variant(f"ours {run.default_artifact.name}", "ours", str(run.default_artifact))]
    variants += [Variant(f"ours {label}", "ours", path) for label, path in built.items()]
    error_of = {v.label: label for v, label in zip(variants[1:], ["reference", *built])}
    notes = []
    if a.optimum_intel_python:
        from bench.optimum_intel import optimum_intel_export

        folder, seconds = optimum_intel_export(a.optimum_intel_python, run.src.folder, run.build, log)
        variants.append(Variant("optimum-intel OVStableDiffusion3Pipeline, its defaults", "optimum-intel",
                                str(folder), a.optimum_intel_python))
        errors["peer"] = _peer_error(run, variants[1], variants[-1])
        error_of[variants[-1].label] = "peer"
        notes.append(f"optimum-intel's export of the same folder (`optimum-cli export openvino --task "
                     f"text-to-image`, its defaults) took {seconds:.0f} s.")
    job = {"height": a.size, "width": a.size}
    jobs = [{"job": "loaded", **job}, {"job": "submodules", "inputs": run.inputs(a.size), **job},  # cold: first calls
            {"job": "submodules", "inputs": run.inputs(a.size, [name]), "calls": 3, **job},
            {"job": "submodules", "inputs": run.inputs(a.size, ["vae_decoder"]), **job},
            {"job": "e2e", "steps": a.steps, **job}]
    samples, peaks, failed = interleaved_fresh(variants, run.constants, jobs, a.openvino_reps, log)
    if failed:
        raise RuntimeError(f"openvino table: {'; '.join(failed.values())}")
    rows = []
    columns = zip(*(against_first(variants, samples, key) for key in (
        lambda s: s[2][name], lambda s: s[3]["vae_decoder"], lambda s: s[4]["seconds"])))
    for (v, step, step_ratio), (_, vae, vae_ratio), (_, e2e, e2e_ratio) in columns:
        first = statistics.median(s[0]["seconds"] + sum(s[1].values()) for s in samples[v.label])
        rows.append([v.label, f"{step.median * 1e3:.0f}", step_ratio, f"{vae.median:.2f}", vae_ratio,
                     f"{e2e.median:.1f}", e2e_ratio, f"{first:.1f}",
                     *accuracy.accuracy_cells(errors.get(error_of.get(v.label), {})), f"{peaks[v.label]:.0f}"])
    timesteps = ", ".join(errors["ort-int8"]["denoiser_rel_err"])
    return [{
        "reps": a.openvino_reps,
        "title": f"CPU runtimes at {a.size}x{a.size}: {name} step (batch 2), VAE decode, end to end "
                 f"({a.steps} steps), error against ort-fp32",
        "columns": ["variant", "step ms", "step speed-up vs (a)", "VAE decode s", "VAE speed-up vs (a)",
                    "end to end s", "speed-up vs (a)", "load + first call of each submodule s",
                    f"image PSNR dB (worst of 4, {a.precision_steps} steps)", "image max abs",
                    f"{name} rel. err at t = {timesteps}", "all finite", "peak RSS MiB"],
        "rows": rows,
        "notes": [f"Medians of {a.openvino_reps} repetitions; each runs every variant in a fresh process, in "
                  "turn: load, one cold call of each submodule (with the load: the load + first call column), "
                  f"three {name} calls, one VAE decode, one end-to-end run. Our calls are made as a run makes "
                  f"them: the {name} keeps its working memory between calls, every other submodule releases it "
                  "after its call. OpenVINO's artifacts compile "
                  f"their IR at load, and a per-size {name} and VAE at their first call of a size, unless compiled for "
                  "the CPU at build (`--ov-device CPU --ov-sizes`). Each step from plain OpenVINO (our export, "
                  "no passes, dynamic shapes) to our default changes one thing. Errors as in the "
                  f"precision table: the same 4 prompts and starting latents; int8 is calibrated on "
                  f"{accuracy.calibration_text(a)}.", *notes]}]


def _arguments(group) -> None:
    group.add_argument("--optimum-intel-python", default=None,
                       help="python of an environment with optimum-intel (make optimum-intel-venv): adds it to the "
                            "openvino table")
    group.add_argument("--openvino-reps", type=int, default=3,
                       help="repetitions of the openvino table (each runs every variant end to end at --size, --steps)")
    group.add_argument("--openvino-variants", default=None,
                       help="comma-separated labels of the openvino table's variants to build and run besides "
                            "ort-int8 (default: all)")


# Its speed reference is diffusers' StableDiffusion3Pipeline, its peer optimum-intel's OVStableDiffusion3Pipeline.
TABLE = Table("openvino", "CPU runtimes at", "ort-int8 and openvino fp32, bf16 and int8, with and without passes, "
              "dynamic and per-size shapes, compiled for the CPU", ("sd3",), measure, _arguments,
              smoke=(*accuracy.SMOKE, "--openvino-reps", "1", "--openvino-variants", "openvino-int8"))
