"""python -m bench: time diffusers, Optimum-ONNX and our artifacts on the same workload, with the
same weights and starting latents, and write BENCHMARKS.md."""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from bench.harness import Variant, interleaved, interleaved_fresh, peak_rss, running, stats
from bench.report import render

SUBMODULES = ("text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae_decoder")


def _log(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--model", default="sd3-bench")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--size", type=int, default=512, help="image side of the per-submodule and first end-to-end runs")
    p.add_argument("--steps", type=int, default=28, help="steps of the first end-to-end run (0: skip it)")
    p.add_argument("--large-size", type=int, default=1024, help="image side of the second end-to-end run (0: skip)")
    p.add_argument("--large-steps", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="add (b) diffusers + torch.compile (compiles for minutes)")
    p.add_argument("--optimum-python", default=None,
                   help="python of an environment with optimum-onnx (make optimum-venv): adds (c)")
    p.add_argument("--out", default="BENCHMARKS.md")
    return p.parse_args(argv)


class Bench:
    def __init__(self, args, command: str):
        from export.source import resolve

        self.args, self.command = args, command
        self.src = resolve(args.model)
        self.build = Path("build") / self.src.entry.name
        self.tables, self.notes = [], []
        self.started = time.perf_counter()

    def prepare(self):
        """Export and build our artifact (cached), and Optimum's export when asked for."""
        from engines.api import build_artifact
        from export.api import export_model
        from runners.manifest import read_manifest

        self.onnx_dir = export_model(self.src, self.build)
        build_artifact(self.build, "ort", "fp32")
        self.onnx_manifest = read_manifest(self.onnx_dir, verify=False)  # export_model just verified it
        self.constants = self.onnx_manifest["constants"]
        self.artifacts = sorted(d for d in self.build.iterdir()
                                if d.is_dir() and d.name not in ("onnx", "optimum") and (d / "manifest.json").exists())
        self.variants = [Variant("(a) diffusers eager", "diffusers", str(self.src.folder))]
        if self.args.compile:
            self.variants.append(Variant("(b) diffusers torch.compile", "diffusers-compile", str(self.src.folder)))
        self.optimum_seconds = None
        if self.args.optimum_python:
            from bench.optimum import optimum_export

            folder, self.optimum_seconds = optimum_export(self.args.optimum_python, self.src.folder, self.build, _log)
            self.variants.append(Variant("(c) optimum-onnx", "optimum", str(folder), self.args.optimum_python))
        else:
            self.notes.append("(c) Optimum-ONNX was not measured in this run: pass --optimum-python (make bench does).")
        self.variants += [Variant(f"(d) ours {a.name}", "ours", str(a)) for a in self.artifacts]
        self.reference = self.variants[0].label

    def measure_gemm(self):
        from bench.gemm import gemm_gflops

        _log("measuring fp32 GEMM throughput")
        self.gemm = gemm_gflops()
        self.rate = max(self.gemm.values()) * 1e9

    def flops(self, size: int) -> dict[str, int]:
        from bench.flops import graph_flops

        c, scale = self.constants, self.constants["vae_scale_factor"]
        dims = {"latent_height": size // scale, "latent_width": size // scale, "image_height": size,
                "image_width": size, "t5_length": 256, "joint_length": c["clip_length"] + 256}
        return {n: graph_flops(self.onnx_dir / f"{n}.onnx", {**dims, "batch": 2 if n == "transformer" else 1})
                for n in SUBMODULES}

    def _row(self, samples: dict, key, label: str):
        ref = [key(s) for s in samples[self.reference]]
        return stats([key(s) for s in samples[label]], None if label == self.reference or not ref else ref)

    def _ratio(self, st, v) -> str:
        return "1 (reference)" if v.label == self.reference else st.ratio_text()

    def measure(self):
        a = self.args
        size, f = a.size, self.flops(a.size)
        job = {"height": size, "width": size}
        with running(self.variants, self.constants, _log) as workers:
            per_call = interleaved(workers, {"job": "submodules", **job}, a.reps, _log)
            if a.steps:
                e2e = interleaved(workers, {"job": "e2e", "steps": a.steps, **job}, a.reps, _log, warmup=False)
                peaks = peak_rss(workers)
        rows = []
        for name in SUBMODULES:
            for v in self.variants:
                st = self._row(per_call, lambda s: s[name], v.label)
                rows.append([name, v.label, f"{f[name] / 1e9:.1f}", f"{st.median * 1e3:.0f}", self._ratio(st, v),
                             f"{st.median / (f[name] / self.rate):.2f}"])
        self.tables.append({"title": f"One call per submodule at {size}x{size} (transformer: one step at batch 2)",
                            "columns": ["submodule", "variant", "GFLOP", "median ms", "speed-up vs (a)", "x bound"],
                            "rows": rows})
        rows = self._e2e_rows(size, a.steps, f, e2e, peaks) if a.steps else []
        if a.large_size:
            large = {"job": "e2e", "height": a.large_size, "width": a.large_size, "steps": a.large_steps}
            samples, peaks, failed = interleaved_fresh(self.variants, self.constants, large, a.reps, _log)
            rows += self._e2e_rows(a.large_size, a.large_steps, self.flops(a.large_size), samples, peaks, failed)
            self.notes.append(f"{a.large_size}x{a.large_size} runs are cold: each comes from a fresh process, stopped "
                              "before the next starts, because the variants' pipelines at that size do not fit in "
                              "memory side by side.")
        if rows:
            self.tables.append({"title": "End to end: prompt and negative prompt, guidance 7, VAE decode",
                                "columns": ["workload", "variant", "TFLOP", "median s", "speed-up vs (a)",
                                            "x bound", "peak RSS MiB"], "rows": rows})

    def _e2e_rows(self, size, steps, f, samples, peaks, failed=None):
        total = 2 * sum(f[n] for n in SUBMODULES[:3]) + steps * f["transformer"] + f["vae_decoder"]
        rows = []
        for v in self.variants:
            if v.label in (failed or {}):
                rows.append([f"{size}x{size}, {steps} steps", v.label, f"{total / 1e12:.2f}", "failed", "-", "-",
                             failed[v.label].split(": ", 1)[1]])
                continue
            st = self._row(samples, lambda s: s["seconds"], v.label)
            rows.append([f"{size}x{size}, {steps} steps", v.label, f"{total / 1e12:.2f}", f"{st.median:.1f}",
                         self._ratio(st, v), f"{st.median / (total / self.rate):.2f}", f"{peaks[v.label]:.0f}"])
        return rows

    def export_table(self):
        from runners.manifest import read_manifest

        built = {a.name: read_manifest(a, verify=False)["submodules"] for a in self.artifacts}
        rows = [[name, f"{sub['export']['export_seconds']:.1f}", f"{sub['export']['seconds_with_checks']:.1f}",
                 f"{sub['export']['bytes'] / 2**20:.0f}", *(f"{built[a][name]['build_seconds']:.1f}" for a in built)]
                for name, sub in self.onnx_manifest["submodules"].items()]
        self.tables.append({"title": "Export and build, seconds (recorded in the manifests by the run that built them)",
                            "columns": ["submodule", "export", "export + parity at 2 shapes", "MiB",
                                        *(f"build {a}" for a in built)], "rows": rows})
        if self.optimum_seconds is not None:
            self.notes.append(f"Optimum-ONNX's export of the same folder (`optimum-cli export onnx --task "
                              f"text-to-image`, legacy exporter, with its own validation) took "
                              f"{self.optimum_seconds:.0f} s.")

    def write(self):
        from export.api import package_versions

        self.notes.append(f"This run took {(time.perf_counter() - self.started) / 60:.1f} minutes, "
                          "preparation included.")
        report = {"command": self.command, "model": self.src.entry.name, "description": self.src.entry.description,
                  "versions": package_versions(("torch", "diffusers", "transformers", "onnxruntime")),
                  "reps": self.args.reps, "gemm": self.gemm, "tables": self.tables, "notes": self.notes}
        Path(self.args.out).write_text(render(report))
        _log(f"wrote {self.args.out}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bench = Bench(_parse(argv), "python -m bench " + " ".join(map(shlex.quote, argv)))
    for stage in (bench.prepare, bench.measure_gemm, bench.measure, bench.export_table, bench.write):
        _log(f"{stage.__name__} ({time.perf_counter() - bench.started:.0f} s in)")
        stage()
    return 0


if __name__ == "__main__":
    sys.exit(main())
