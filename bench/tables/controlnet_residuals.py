"""The ControlNet residual table: what the denoiser's ControlNet residual inputs cost a step that runs without
a ControlNet (zeros added), against the same graph with their additions taken out. The U-Net families'
real layouts always have them (export/families/unet.py); this measures that choice."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from bench.harness import in_child, log, stats, timed_calls
from bench.tables import Table
from bench.workload import make_inputs


def strip_residuals(source: Path, names: list[str], out: Path) -> None:
    """The graph at `source` without the additions of its inputs `names`: each is added to the hidden stream
    by one Add, whose uses then take the stream itself. The inputs stay, fed as before: the exporter reads
    some of the graph's dims from their shapes. The weights stay in `source`'s external data, linked."""
    import onnx_ir as ir

    model = ir.load(source)
    for value in [v for v in model.graph.inputs if v.name in names]:
        adds = [(node, index) for node, index in value.uses() if node.op_type == "Add"]
        if len(adds) != 1:
            raise ValueError(f"{source.name}: residual input {value.name} feeds {len(adds)} Adds, not one")
        add, index = adds[0]
        ir.convenience.replace_all_uses_with(add.outputs[0], add.inputs[1 - index])
        model.graph.remove(add, safe=True)
    for data in source.parent.glob(f"{source.name}.data"):
        os.link(data, out.parent / data.name)
    ir.save(model, out)


def _calls(artifact: str, denoiser: str, inputs: dict, reps: int) -> dict:
    """In a fresh process: the denoiser's call with zeros added by its residual inputs, and without the adds."""
    from runners.backends.ort import OrtSession
    from runners.controlnet import residual_inputs
    from runners.manifest import read_manifest

    entry = read_manifest(Path(artifact), verify=False)["submodules"][denoiser]
    names = [t["name"] for t in residual_inputs(entry)]
    feeds = make_inputs({denoiser: inputs})[denoiser]
    feeds.update({n: np.zeros_like(feeds[n]) for n in names})
    with tempfile.TemporaryDirectory(prefix="bench-residuals-") as scratch:
        stripped = Path(scratch) / entry["file"]
        strip_residuals(Path(artifact) / entry["file"], names, stripped)
        options = dict(session_config=entry.get("session_config"), session_options=entry.get("session_options"))
        full, plain = OrtSession(Path(artifact) / entry["file"], **options), OrtSession(stripped, **options)
        times = timed_calls({"with": lambda: full.run(feeds), "without": lambda: plain.run(feeds)}, reps)
    return {"times": times, "inputs": len(names), "bytes": sum(feeds[n].nbytes for n in names)}


def measure(run) -> list[dict]:
    a, denoiser = run.args, run.denoiser
    log(f"controlnet-residuals: {denoiser} with and without its residual additions")
    found = in_child(_calls, str(run.default_artifact), denoiser, run.inputs(a.size, [denoiser])[denoiser],
                     a.residuals_reps)
    without = found["times"]["without"]
    rows = []
    for label, key in (("with its residual inputs, zeros added", "with"), ("without their additions", "without")):
        st = stats(found["times"][key], None if key == "without" else without)
        rows.append([label, str(found["inputs"] if key == "with" else 0),
                     f"{found['bytes'] / 2**20:.1f}" if key == "with" else "0", f"{st.median * 1e3:.1f}",
                     "reference" if key == "without" else f"{(1 / st.ratio - 1) * 100:+.1f}%"])
    return [{
        "reps": a.residuals_reps,
        "title": f"ControlNet residual inputs on the plain path at {a.size}x{a.size} ({denoiser}, one call at batch "
                 "2, ort-fp32)",
        "columns": ["denoiser graph", "residual inputs added", "MiB added per call", "median ms", "cost vs without"],
        "rows": rows,
        "notes": [f"Medians of {a.residuals_reps} calls of each graph, interleaved in one process after a warm-up "
                  "call, with the same inputs. The graph without their additions is the artifact's with each "
                  "residual's Add taken out (bench/tables/controlnet_residuals.py): what a second, plain denoiser graph would "
                  "compute. The residual inputs stay in it (the exporter reads some dims from their shapes); on "
                  "the CPU a fed array is not copied, and the runner makes its zeros once per shape."]}]


def _arguments(group) -> None:
    group.add_argument("--residuals-reps", type=int, default=10,
                       help="calls of each graph in the ControlNet residual table")


TABLE = Table("controlnet-residuals", "ControlNet residual inputs", "the denoiser without its residual additions",
              ("sd15", "sdxl"), measure, _arguments, smoke=("--residuals-reps", "2"))
