"""One call of each text-to-image submodule, in every variant's own process: diffusers eager
(the reference), the peers asked for, and our default artifact."""
from __future__ import annotations

from bench.harness import against_first, interleaved, log, running
from bench.tables import Table


def measure(run) -> list[dict]:
    size = run.args.size
    flops = run.flops(size)
    with running(run.variants, run.constants, log) as workers:
        samples = interleaved(workers, {"job": "submodules", "inputs": run.inputs(size), "height": size,
                                        "width": size}, run.args.reps, log)
    rows = []
    for name, f in flops.items():
        for v, st, ratio in against_first(run.variants, samples, lambda s: s[name]):
            rows.append([name, v.label, f"{f / 1e9:.1f}", f"{st.median * 1e3:.0f}", ratio,
                         f"{st.median / (f / run.rate):.2f}"])
    return [{"title": f"One call per submodule at {size}x{size} ({run.denoiser}: one step at batch 2)",
             "columns": ["submodule", "variant", "GFLOP", "median ms", "speed-up vs (a)", "x bound"], "rows": rows}]


TABLE = Table("submodules", "One call per submodule", "nothing", ("sd3",), measure)
