"""FLUX.2's reference tokens table: a step's transformer with 0, 1 and 2 reference images, their tokens
recomputed (klein's transformer, and the KV checkpoint's first step: `transformer_kv_extract`) against their
keys and values read (the KV checkpoint's other steps: its `transformer`, export/families/flux2_kv.py). On a
klein export only the first column exists: its references cannot be cached (they are modulated at the step's
timestep and attend to the noisy image); on a KV export (flux2-klein-kv-bench) both do."""
from __future__ import annotations

from pathlib import Path

from bench.harness import GRAPH_CALLS, graph_calls, in_child, log, stats
from bench.tables import Table
from bench.workload import call_dims

EXTRACT = "transformer_kv_extract"


def _specs(src, constants: dict, name: str, size: int, references: int) -> dict:
    """The input specs of one call of graph `name` at `size`, batch 1, with `references` references of the
    output's size."""
    from export.shapes import concrete

    dims = call_dims(src, constants, size, 1)
    reference_tokens = references * dims["latent_height"] * dims["latent_width"]
    dims.update(reference_tokens=reference_tokens, image_tokens=dims["image_tokens"] + reference_tokens)
    spec = next(s for s in src.family.submodules if s.applies(src) and s.name == name)
    return {t.name: {"shape": list(concrete(t.shape, dims, constants)), "dtype": t.dtype,
                     "high": constants[t.high] if isinstance(t.high, str) else t.high} for t in spec.inputs}


def measure(run) -> list[dict]:
    from runners.manifest import read_manifest

    a, artifact = run.args, Path(run.default_artifact)
    submodules = read_manifest(artifact, verify=False)["submodules"]
    kv = EXTRACT in submodules
    # (label, graph, references, the inputs' way): klein's transformer takes the references' tokens; KV's
    # cached transformer their keys and values, its extract graph their tokens
    cases = [("none", "transformer", 0)]
    for refs in (1, 2):
        cases.append((f"{refs}, recomputed", EXTRACT if kv else "transformer", refs))
        if kv:
            cases.append((f"{refs}, keys and values read", "transformer", refs))
    log(f"flux2-references: {len(cases)} transformer calls at {a.size}x{a.size}, {a.references_reps} processes each")
    times = {label: [] for label, _, _ in cases}
    for _ in range(a.references_reps):
        for label, graph, refs in cases:
            entry = submodules[graph]
            specs = _specs(run.src, run.constants, graph, a.size, refs)
            times[label] += in_child(graph_calls, str(artifact / entry["file"]), entry, specs, ())
    none = times["none"]
    rows = []
    for label, graph, refs in cases:
        st = stats(times[label], none)
        one = times.get(label.replace("2,", "1,")) if refs == 2 else None
        rows.append([label, graph, f"{st.median * 1e3:.1f}", f"{1 / st.ratio:.2f}x" if refs else "1 (reference)",
                     f"{stats(times[label], one).ratio ** -1:.2f}x" if one else "-"])
    return [{
        "reps": a.references_reps,
        "title": f"FLUX.2's reference images on a step at {a.size}x{a.size} ({run.src.entry.name}, ort-fp32, batch 1, "
                 "references of the output's size)",
        "columns": ["references", "graph", "median ms", "vs none", "2 vs 1"],
        "rows": rows,
        "notes": [f"Medians of {a.references_reps * GRAPH_CALLS} calls of each graph with seeded inputs: {GRAPH_CALLS} "
                  f"calls after a warm-up in each of {a.references_reps} fresh processes per case, one process at a "
                  "time (bench/tables/flux2_references.py). 'recomputed': the references' tokens go through every "
                  "block at every step (klein 4B and 9B: they are modulated at the step's timestep and attend to the "
                  "noisy image, so no step can reuse them; klein KV's first step). 'keys and values read': klein "
                  "KV's other steps, whose references were modulated at timestep 0 and attended only to each other "
                  "(Flux2KleinKVPipeline). " + ("" if kv else "This export is not a KV checkpoint's: run "
                                                "--model flux2-klein-kv-bench for the second way.")]}]


def _arguments(group) -> None:
    group.add_argument("--references-reps", type=int, default=3,
                       help=f"fresh processes per case in FLUX.2's reference table ({GRAPH_CALLS} calls each)")


TABLE = Table("flux2-references", "FLUX.2's reference images on a step", "nothing", ("flux2",), measure, _arguments,
              smoke=("--references-reps", "1"))
