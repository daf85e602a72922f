"""The First-Block Cache split table: what the split costs a step that runs uncached. Every SD3 and Flux
transformer export gives `tail_residual` beside its prediction (export/families/first_block.py), so that
First-Block Cache needs no export flag; this times the ort-fp32 transformer as exported against the same
graph without that output (and the subtraction that makes it)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from bench.harness import GRAPH_CALLS, alternating_graph_calls, in_prepared_child, log, stats
from bench.tables import Table

OUTPUT = "tail_residual"


def strip_output(source: Path, name: str, out: Path) -> None:
    """The graph at `source` without its output `name` and the nodes only it used. The weights stay in
    `source`'s external data, linked."""
    import onnx_ir as ir
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    model = ir.load(source)
    outputs = model.graph.outputs
    if name not in [v.name for v in outputs]:
        raise ValueError(f"{source.name} has no output {name}: exported before the First-Block Cache split")
    outputs.pop(next(i for i, v in enumerate(outputs) if v.name == name))
    RemoveUnusedNodesPass()(model)
    for data in source.parent.glob(f"{source.name}.data"):
        os.link(data, out.parent / data.name)
    ir.save(model, out)


def measure(run) -> list[dict]:
    from runners.manifest import read_manifest

    a, denoiser, artifact = run.args, run.denoiser, Path(run.default_artifact)
    log(f"first-block-split: {denoiser} with and without its {OUTPUT} output")
    entry = read_manifest(artifact, verify=False)["submodules"][denoiser]
    inputs = run.inputs(a.size, [denoiser])[denoiser]
    with tempfile.TemporaryDirectory(prefix="bench-split-") as scratch:
        graphs = {"with": artifact / entry["file"], "without": Path(scratch) / entry["file"]}
        in_prepared_child(strip_output, graphs["with"], OUTPUT, graphs["without"])
        times = alternating_graph_calls(graphs, entry, inputs, a.split_reps)
    rows = []
    for label, key in ((f"as exported, with {OUTPUT}", "with"), (f"without {OUTPUT}", "without")):
        st = stats(times[key], None if key == "without" else times["without"])
        rows.append([label, f"{st.median * 1e3:.1f}",
                     "reference" if key == "without" else f"{(1 / st.ratio - 1) * 100:+.1f}%"])
    return [{
        "reps": a.split_reps,
        "title": f"First-Block Cache's split on an uncached step at {a.size}x{a.size} ({denoiser} of "
                 f"{run.src.entry.name}, one call at batch 2, ort-fp32)",
        "columns": ["transformer graph", "median ms", "cost vs without"],
        "rows": rows,
        "notes": [f"Medians of {a.split_reps * GRAPH_CALLS} calls of each graph with the same inputs: {GRAPH_CALLS} "
                  f"calls after a warm-up in each of {a.split_reps} fresh processes per graph, one process at a time, "
                  f"the graphs alternating. The graph without {OUTPUT} is the artifact's with that output and the "
                  "nodes only it used taken out (bench/tables/first_block_split.py): what an export without the "
                  "split would run."]}]


def _arguments(group) -> None:
    group.add_argument("--split-reps", type=int, default=3,
                       help=f"fresh processes per graph in the First-Block Cache split table ({GRAPH_CALLS} calls "
                            "each)")


TABLE = Table("first-block-split", "First-Block Cache's split on an uncached step",
              f"the transformer without {OUTPUT}", ("sd3", "flux"), measure, _arguments, smoke=("--split-reps", "1"))
