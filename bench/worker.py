"""One variant in its own process: load it, then answer JSON jobs read from stdin, one per line.
Results are written on stdout behind a marker, so library output cannot be mistaken for them.
Peak RSS is this process's own: variants never share a process."""
from __future__ import annotations

import json
import statistics
import sys
import time

MARK = "@@bench "


def _reply(obj) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def peak_rss_mib() -> float:
    """VmHWM: the peak resident set of this process image. (ru_maxrss is not used: Linux carries
    it across fork and exec, so a worker would report its parent's peak.)"""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main() -> None:
    from bench.family_variants import WORKLOADS, make_family_variant
    from bench.flux_variants import make_flux_variant
    from bench.variants import make_variant
    from bench.workload import make_inputs, start_latents

    kind, path, constants, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
    t0 = time.perf_counter()
    # a family table's variants are its own module's, named by their kind's prefix
    by_prefix = {"flux-": make_flux_variant, **{f"{w}-": make_family_variant for w in WORKLOADS}}
    make = next((f for prefix, f in by_prefix.items() if kind.startswith(prefix)), make_variant)
    variant = make(kind, path, **options)
    loaded = time.perf_counter() - t0
    _reply({"loaded_seconds": loaded})
    for line in sys.stdin:
        job = json.loads(line)
        h, w = job["height"], job["width"]
        if job["job"] == "submodules":  # one call of each submodule whose inputs the job specifies
            feeds, calls = make_inputs(job["inputs"]), job.get("calls", 1)
            _reply({name: statistics.median(variant.call(name, feeds[name]) for _ in range(calls)) for name in feeds})
        elif job["job"] == "timed_run":  # a whole run, its denoiser and VAE times, and its first image
            _reply(variant.timed_run(start_latents(constants, h, w, job.get("frames")), h, w, job["steps"],
                                     job.get("out")))
        elif job["job"] == "e2e":
            _reply({"seconds": variant.e2e(start_latents(constants, h, w), h, w, job["steps"])})
        elif job["job"] == "vae_decode":
            z = start_latents(constants, h, w, job.get("frames"))
            _reply({"seconds": variant.vae_decode(z, job["tiling"], job.get("tile"))})
        elif job["job"] == "loaded":
            _reply({"seconds": loaded})
        elif job["job"] == "images":  # written as .npy files: a job's reply is one line of JSON
            latents = start_latents(constants, h, w)
            _reply({"files": variant.images(job["prompts"], latents, h, w, job["steps"], job["out"])})
        elif job["job"] == "peak_rss":
            _reply({"peak_rss_mib": peak_rss_mib()})


if __name__ == "__main__":
    main()
