"""The ControlNet residual table: what the denoiser's ControlNet residual inputs cost a step that runs without
a ControlNet (zeros added), against the same graph with their additions taken out. The U-Net families'
real layouts always have them (export/families/unet.py); this measures that choice. SD3's and Flux's
transformers take them (one per block) only in an export with ControlNets, whose plain path this measures."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from bench.harness import GRAPH_CALLS, alternating_graph_calls, in_prepared_child, log, stats
from bench.tables import Table
from bench.tables.controlnet import with_controlnets


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


def _with_residuals(run) -> Path:
    """An ort-fp32 artifact whose denoiser takes ControlNet residual inputs: the default one where it always
    does (the U-Nets' real layouts), else the model's export with its random ControlNets (SD3's and Flux's
    transformers take them only there)."""
    from runners.conditioning.controlnet import residual_inputs
    from runners.manifest import read_manifest

    if residual_inputs(read_manifest(run.default_artifact, verify=False)["submodules"][run.denoiser]):
        return Path(run.default_artifact)
    return with_controlnets(run, "controlnet-residuals")[0] / Path(run.default_artifact).name


def measure(run) -> list[dict]:
    from export.shapes import concrete
    from runners.conditioning.controlnet import residual_inputs
    from runners.manifest import read_manifest

    a, denoiser, artifact = run.args, run.denoiser, _with_residuals(run)
    log(f"controlnet-residuals: {denoiser} with and without its residual additions")
    entry = read_manifest(artifact, verify=False)["submodules"][denoiser]
    residuals, dims = residual_inputs(entry), run.dims(a.size, denoiser)
    names = [t["name"] for t in residuals]
    # The family's denoiser inputs, and the residuals as the manifest has them (the transformers' spec lacks them)
    inputs = {**run.inputs(a.size, [denoiser])[denoiser],
              **{t["name"]: {"shape": list(concrete(t["shape"], dims, run.constants)), "dtype": t["dtype"],
                             "high": None} for t in residuals}}
    with tempfile.TemporaryDirectory(prefix="bench-residuals-") as scratch:
        graphs = {"with": artifact / entry["file"], "without": Path(scratch) / entry["file"]}
        in_prepared_child(strip_residuals, graphs["with"], names, graphs["without"])
        times = alternating_graph_calls(graphs, entry, inputs, a.residuals_reps, zeros=tuple(names))
    added = sum(int(np.prod(inputs[n]["shape"])) * 4 for n in names) / 2**20
    rows = []
    for label, key in (("with its residual inputs, zeros added", "with"), ("without their additions", "without")):
        st = stats(times[key], None if key == "without" else times["without"])
        rows.append([label, str(len(names)) if key == "with" else "0", f"{added:.1f}" if key == "with" else "0",
                     f"{st.median * 1e3:.1f}", "reference" if key == "without" else f"{(1 / st.ratio - 1) * 100:+.1f}%"])
    where = ("the default artifact's" if artifact == Path(run.default_artifact) else
             f"that of the model's export with its random ControlNets ({artifact.parent.name})")
    return [{
        "reps": a.residuals_reps,
        "title": f"ControlNet residual inputs on the plain path at {a.size}x{a.size} ({denoiser} of "
                 f"{run.src.entry.name}, one call at batch 2, ort-fp32)",
        "columns": ["denoiser graph", "residual inputs added", "MiB added per call", "median ms", "cost vs without"],
        "rows": rows,
        "notes": [f"Medians of {a.residuals_reps * GRAPH_CALLS} calls of each graph with the same inputs: "
                  f"{GRAPH_CALLS} calls after a warm-up in each of {a.residuals_reps} fresh processes per graph, "
                  f"one process at a time, the graphs alternating. The graph with them is {where}. The graph "
                  "without their additions is that artifact's with each residual's Add taken out "
                  "(bench/tables/controlnet_residuals.py): what a second, plain denoiser graph would compute. The "
                  "residual inputs stay in it (the exporter reads some dims from their shapes); on the CPU a fed "
                  "array is not copied, and the runner makes its zeros once per shape."]}]


def _arguments(group) -> None:
    group.add_argument("--residuals-reps", type=int, default=3,
                       help=f"fresh processes per graph in the ControlNet residual table ({GRAPH_CALLS} calls "
                            "each)")


TABLE = Table("controlnet-residuals", "ControlNet residual inputs", "the denoiser without its residual additions",
              ("sd3", "sd15", "sdxl", "flux"), measure, _arguments, smoke=("--residuals-reps", "1"))
