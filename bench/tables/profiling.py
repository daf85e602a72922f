"""What `profile=` costs end to end, and what the runner costs with it off."""
from __future__ import annotations

from bench.harness import Variant, against_first, interleaved, log, running
from bench.tables import Table


def measure(run) -> list[dict]:
    a, artifact = run.args, str(run.default_artifact)
    variants = [Variant("ours, without the profiling hook", "ours-without-hook", artifact),
                Variant("ours, profiling off", "ours", artifact),
                Variant("ours, profile=DIR", "ours-profiled", artifact)]
    job = {"job": "e2e", "steps": a.profiling_steps, "height": a.size, "width": a.size}
    with running(variants, run.constants, log) as workers:
        samples = interleaved(workers, job, a.reps, log)
    rows = [[v.label, f"{st.median:.2f}", ratio]
            for v, st, ratio in against_first(variants, samples, lambda s: s["seconds"])]
    return [{
        "title": f"Profiling cost, end to end at {a.size}x{a.size}, {a.profiling_steps} steps ({run.default_artifact.name})",
        "columns": ["runner", "median s", "speed vs without the hook"], "rows": rows,
        "notes": ["'Without the profiling hook' replaces `Pipeline.run` by a direct session call, as it was "
                  "before profiling existed; with profiling off the runner's only extra work per engine call "
                  "is one `is None` check. With it on, the call reopens every session with ONNX Runtime's "
                  "profiler (inside the timed call), records each operator, and writes one trace file per "
                  "engine call."]}]


def _arguments(group) -> None:
    group.add_argument("--profiling-steps", type=int, default=4, help="steps of the profiling-cost runs")


# Its end-to-end job passes SD3's max_sequence_length (bench.variants.Ours).
TABLE = Table("profiling", "Profiling cost", "nothing", ("sd3",), measure, _arguments,
              smoke=("--profiling-steps", "1"))
