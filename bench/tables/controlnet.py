"""The ControlNet steps table: the model exported with its random ControlNets (export/families/controlnet.py),
a step with none, one and two of them running, on ort-fp32 and openvino-int8, against diffusers eager with
one; and milliseconds per GFLOP, of the denoiser's step and of what each ControlNet adds to it."""
from __future__ import annotations

import statistics
from pathlib import Path

from bench import accuracy
from bench.harness import Variant, in_prepared_child, interleaved_fresh, log
from bench.tables import Table
from bench.tables.openvino import build_openvino


def export_with_controlnets(model: str, build: str, names: list[str]) -> str:
    """The model's export beside `build` with the ControlNets `names` (its other graphs linked from `build`),
    built for ort-fp32; returns the build folder."""
    from engines.api import build_artifact
    from export.api import export_model

    folder = Path(build).parent / f"{Path(build).name}-controlnets"
    export_model(model, folder, controlnets=names, reuse_from=Path(build).parent)
    build_artifact(folder, "ort", "fp32")
    return str(folder)


def with_controlnets(run, table: str) -> tuple[Path, list[str]]:
    """The run's model exported with its random ControlNets (the first two) and built for ort-fp32, in a
    child process: (that build folder, their names)."""
    from export.families.controlnet import random_controlnets

    model = run.src.entry.name
    names = random_controlnets(model)[:2]
    if not names:
        raise ValueError(f"{table} table: no random ControlNets are made for {model} "
                         "(export/families/controlnet.py: RANDOM_CONTROLNETS)")
    log(f"{table}: exporting {model} with {', '.join(names)}")
    return Path(in_prepared_child(export_with_controlnets, model, str(run.build), names)), names


def _graph_flops(folder: Path, run, names: list[str]) -> dict[str, int]:
    """MatMul, Gemm and Conv FLOPs of one call of each engine `names` at the denoiser's call dims."""
    from engines.memory.graph import graph_flops

    dims = run.dims(run.args.size, run.denoiser)
    return {n: graph_flops(folder / "onnx" / f"{n}.onnx", dims) for n in names}


def measure(run) -> list[dict]:
    from export.families.controlnet import folder_of

    a = run.args
    folder, names = with_controlnets(run, "controlnet")
    artifacts = {"ort-fp32": str(folder / "ort-fp32"),
                 **in_prepared_child(build_openvino, folder, accuracy.calibration(a), a.size,
                            [n for n in a.controlnet_artifacts.split(",") if n != "ort-fp32"])}
    variants = [Variant("(a) diffusers eager, 1 ControlNet", "diffusers-controlnet", str(run.src.folder),
                        options={"controlnet": str(folder_of(names[0]))})]
    variants += [Variant(f"ours {label}, {k} ControlNet{'s' if k != 1 else ''}", "ours", path, options={"controls": k})
                 for label, path in artifacts.items() for k in range(len(names) + 1)]
    job = {"job": "timed_run", "steps": a.steps, "height": a.size, "width": a.size, "out": None}
    # One process at a time: a real model's artifact with its ControlNets holds several GB per process.
    samples, _, failed = interleaved_fresh(variants, run.constants, job, a.controlnet_reps, log, warmup=True)
    if failed:
        raise RuntimeError(f"controlnet table: {'; '.join(failed.values())}")
    step = {v.label: statistics.median(r["step"] for r in samples[v.label]) for v in variants}
    flops = _graph_flops(folder, run, [run.denoiser, "controlnet"])
    rows = []
    for v in variants:
        k = v.options.get("controls")
        plain = next((u.label for u in variants if u.path == v.path and u.options == {"controls": 0}), None)
        added = step[v.label] - step[plain] if k else None
        per_gflop = (f"{step[v.label] / (flops[run.denoiser] / 1e9) * 1e3:.2f}" if k == 0 else
                     f"{added / k / (flops['controlnet'] / 1e9) * 1e3:.2f}" if k else "-")
        against = "reference" if v is variants[0] else f"{step[variants[0].label] / step[v.label]:.2f}x" if k == 1 \
            else "-"
        rows.append([v.label, f"{step[v.label]:.3f}", f"{added:+.3f}" if added is not None else "-", against,
                     per_gflop])
    return [{
        "reps": a.controlnet_reps,
        "title": f"ControlNet steps at {a.size}x{a.size}, {a.steps} steps: a step with none, one and two "
                 "ControlNets, and ms per GFLOP of the denoiser and of what a ControlNet adds",
        "columns": ["variant", "s per step", "s added by the ControlNets", "speed-up vs (a), one ControlNet each",
                    "ms per GFLOP (0: denoiser; else: per ControlNet added)"],
        "rows": rows,
        "notes": [f"Medians of {a.controlnet_reps} repetitions of a {a.steps}-step run at guidance (batch 2), each "
                  "in a fresh process of its variant (one at a time: they do not fit the memory together) after a "
                  "dropped warm-up run. A step is the denoiser's "
                  "evaluation with the ControlNets that run (`Pipeline.timings`; diffusers': its UNet's and "
                  "ControlNet's calls). One ControlNet on an artifact of two runs the other at scale 0, which the "
                  "runner skips. GFLOP: MatMul, Gemm and Conv FLOPs of one call at batch 2 counted from the graphs "
                  f"({run.denoiser} {flops[run.denoiser] / 1e9:.1f}, controlnet {flops['controlnet'] / 1e9:.1f}). "
                  "The ControlNets are random "
                  f"({', '.join(names)}: the base UNet's encoder with random output convolutions)."
                  + (f" openvino-int8 is calibrated on {accuracy.calibration_text(a)}, with the ControlNets running."
                     if len(artifacts) > 1 else "")]}]


def _arguments(group) -> None:
    group.add_argument("--controlnet-reps", type=int, default=3, help="repetitions of the ControlNet steps table")
    group.add_argument("--controlnet-artifacts", default="ort-fp32,openvino-int8",
                       help="comma-separated artifacts of the ControlNet steps table (ort-fp32 or the openvino "
                            "table's labels)")


TABLE = Table("controlnet", "ControlNet steps", "the model with its random ControlNets (ort-fp32, openvino int8)",
              ("sd15",), measure, _arguments,
              smoke=(*accuracy.SMOKE, "--controlnet-reps", "1", "--controlnet-artifacts", "ort-fp32"))
