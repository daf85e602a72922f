"""Where the denoiser step's time goes in the graph the ORT target builds: per op type, its time,
its FLOPs and how far it runs from its own FLOP bound."""
from __future__ import annotations

from bench.harness import in_child, in_prepared_child
from bench.tables import Table
from bench.tables.passes import build_with_passes, op_profile

COVERED = 0.97  # ops are listed until this share of the kernel time is shown


def measure(run) -> list[dict]:
    from engines.memory.graph import graph_flops_by_op

    size, name, label = run.args.size, run.denoiser, "all (ort default)"
    graph = in_prepared_child(build_with_passes, run.onnx_dir, run.build / "passes", name, [label])[label][0]
    seconds = in_child(op_profile, graph, run.inputs(size, [name]))
    flops = in_child(graph_flops_by_op, graph, run.dims(size, name))
    total = sum(seconds.values())
    rows, shown = [], 0.0
    for op, t in seconds.items():
        if shown >= COVERED * total:
            break
        shown += t
        f = flops.get(op)
        rows.append([op, f"{t * 1e3:.0f}", f"{100 * t / total:.1f}%", f"{f / 1e9:.1f}" if f else "-",
                     f"{f / t / 1e9:.0f}" if f else "-", f"{t / (f / run.rate):.2f}" if f else "-"])
    rows.append(["all ops", f"{total * 1e3:.0f}", "100%", f"{sum(flops.values()) / 1e9:.1f}",
                 f"{sum(flops.values()) / total / 1e9:.0f}", f"{total / (sum(flops.values()) / run.rate):.2f}"])
    return [{
        "title": f"{name.capitalize()} step at {size}x{size}, batch 2, by op type (ort target, all passes)",
        "columns": ["op type", "ms", "share", "GFLOP", "GFLOP/s", "x own bound"], "rows": rows,
        "notes": ["ONNX Runtime's profiler, one steady-state call (the second) in the runner's session settings; "
                  f"ops are listed until {COVERED:.0%} of the kernel time is covered. Rows without FLOPs are "
                  "memory-bound ops (Add, Gelu, LayerNorm, reshapes)."]}]


TABLE = Table("profile", "Transformer step at", "the denoiser with the ort target's passes", ("sd3",), measure)
