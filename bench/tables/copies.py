"""What the runner's output copies cost (runners/backends/__init__.py: a backend may reuse its
output buffers, so the pipeline copies an output it keeps past the next call). Each kept output is
timed against the engine call that produced it, on the ORT artifact, in this process."""
from __future__ import annotations

import statistics
import time

from bench.tables import Table
from bench.workload import make_inputs

COPY_REPS = 20  # a copy takes milliseconds: many repetitions for a stable median


def _median_seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(run) -> list[dict]:
    from runners.pipeline import Pipeline

    artifact, size, reps, name = run.default_artifact, run.args.size, run.args.reps, run.denoiser
    kept = {  # what the pipeline keeps: the denoiser's output (PLMS's history), the VAE's (tiles, results)
        name: "PLMS's past noise predictions (one per step; SD1.5's default scheduler)",
        "vae_decoder": "a VAE tile or the image vae_decode returns (one per decoder call)",
    }
    inputs = make_inputs(run.inputs(size, list(kept)))
    outputs = run.onnx_manifest["submodules"]
    pipe = Pipeline.load(artifact, submodules=list(kept))
    rows = []
    with pipe:
        for submodule, why in kept.items():
            feeds, output = inputs[submodule], outputs[submodule]["outputs"][0]["name"]
            result = pipe.run(submodule, **feeds)[output]
            call = _median_seconds(lambda: pipe.run(submodule, **feeds), reps)
            copy = _median_seconds(result.copy, COPY_REPS)
            rows.append([submodule, f"{output} {tuple(result.shape)}", why, f"{result.nbytes / 2**20:.1f}",
                         f"{copy * 1e3:.2f}", f"{call * 1e3:.0f}", f"{100 * copy / call:.3f}%"])
    return [{"title": f"Output copies: what the runner copies, against the call that made it ({size}x{size})",
             "columns": ["engine", "output", "kept as", "MiB", "copy ms", "call ms", "copy / call"], "rows": rows,
             "notes": [f"{artifact.name}; the call is the median of {reps}, the copy (numpy) the median of "
                       f"{COPY_REPS}. The {name} runs at batch 2 (guidance), the VAE decoder at batch 1. "
                       "Every other output is consumed before the engine's next call and is not copied."]}]


TABLE = Table("copies", "Output copies", "nothing", ("sd3", "sd15", "sdxl"), measure)
