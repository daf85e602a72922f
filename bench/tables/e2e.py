"""Whole text-to-image runs of every variant: prompt and negative prompt, guidance, VAE decode;
at --size (workers kept loaded, interleaved) and at --large-size (a fresh process per run: the
variants' pipelines at that size do not fit in memory side by side)."""
from __future__ import annotations

from bench.harness import interleaved, interleaved_fresh, log, peak_rss, running, stats
from bench.tables import Table
from bench.workload import text_encoders


def _rows(run, size: int, steps: int, samples: dict, peaks: dict, failed: dict) -> list[list[str]]:
    f = run.flops(size)
    # Each text encoder runs twice (prompt and negative prompt), the denoiser once per step at batch 2.
    total = (2 * sum(f[n] for n in text_encoders(run.onnx_manifest)) + steps * f[run.denoiser]
             + f["vae_decoder"])
    workload, reference = f"{size}x{size}, {steps} steps", [s["seconds"] for s in samples[run.variants[0].label]]
    rows = []
    for v in run.variants:
        if v.label in failed:
            rows.append([workload, v.label, f"{total / 1e12:.2f}", "failed", "-", "-", failed[v.label].split(": ", 1)[1]])
            continue
        first = v is run.variants[0]
        st = stats([s["seconds"] for s in samples[v.label]], None if first or not reference else reference)
        rows.append([workload, v.label, f"{total / 1e12:.2f}", f"{st.median:.1f}",
                     "1 (reference)" if first else st.ratio_text(), f"{st.median / (total / run.rate):.2f}",
                     f"{peaks[v.label]:.0f}"])
    return rows


def measure(run) -> list[dict]:
    a, rows, notes = run.args, [], []
    if a.steps:
        job = {"job": "e2e", "steps": a.steps, "height": a.size, "width": a.size}
        with running(run.variants, run.constants, log) as workers:
            samples = interleaved(workers, job, a.reps, log)
            rows += _rows(run, a.size, a.steps, samples, peak_rss(workers), {})
    if a.large_size:
        large = {"job": "e2e", "height": a.large_size, "width": a.large_size, "steps": a.large_steps}
        samples, peaks, failed = interleaved_fresh(run.variants, run.constants, large, a.reps, log)
        rows += _rows(run, a.large_size, a.large_steps, samples, peaks, failed)
        notes.append(f"{a.large_size}x{a.large_size} runs are cold: each comes from a fresh process, stopped "
                     "before the next starts, because the variants' pipelines at that size do not fit in "
                     "memory side by side.")
    return [{"title": "End to end: prompt and negative prompt, guidance 7, VAE decode",
             "columns": ["workload", "variant", "TFLOP", "median s", "speed-up vs (a)", "x bound", "peak RSS MiB"],
             "rows": rows, "notes": notes}] if rows else []


def _arguments(group) -> None:
    group.add_argument("--large-size", type=int, default=1024, help="image side of the second end-to-end run (0: skip)")
    group.add_argument("--large-steps", type=int, default=2)


TABLE = Table("e2e", "End to end", "nothing", ("sd3",), measure, _arguments,
              smoke=("--large-size", "256", "--large-steps", "1"))
