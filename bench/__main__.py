"""python -m bench: time diffusers and our artifacts on the same workload; write BENCHMARKS.md."""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from bench.harness import Variant, interleaved, stats
from bench.report import render

SUBMODULES = ("text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae_decoder")


def _log(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--model", default="sd3-bench")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--size", type=int, default=512, help="image side of the submodule and first end-to-end runs")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--large-size", type=int, default=1024, help="image side of the second end-to-end run (0: skip)")
    p.add_argument("--large-steps", type=int, default=4)
    p.add_argument("--compile", action="store_true", help="add diffusers + torch.compile (compiles for minutes)")
    p.add_argument("--out", default="BENCHMARKS.md")
    args = p.parse_args(argv)
    command = "python -m bench " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv))

    from bench.flops import graph_flops
    from bench.gemm import gemm_gflops
    from engines.api import build_artifact
    from export.api import export_model, package_versions
    from export.source import resolve
    from runners.manifest import read_manifest

    src = resolve(args.model)
    build = Path("build") / src.entry.name
    onnx_dir = export_model(src, build)
    build_artifact(build, "ort", "fp32")
    onnx_manifest = read_manifest(onnx_dir)
    constants = onnx_manifest["constants"]
    artifacts = sorted(d for d in build.iterdir() if d.is_dir() and d.name != "onnx" and (d / "manifest.json").exists())

    variants = [Variant("(a) diffusers eager", "diffusers", str(src.folder))]
    if args.compile:
        variants.append(Variant("(b) diffusers torch.compile", "diffusers-compile", str(src.folder)))
    variants += [Variant(f"(d) ours {a.name}", "ours", str(a)) for a in artifacts]
    ref = variants[0].label

    _log("measuring GEMM throughput")
    gemm = gemm_gflops()
    rate = max(gemm.values()) * 1e9

    def dims(size, batch):
        scale = constants["vae_scale_factor"]
        return {"batch": batch, "latent_height": size // scale, "latent_width": size // scale,
                "image_height": size, "image_width": size, "t5_length": 256, "joint_length": constants["clip_length"] + 256}

    def flops(size):
        return {name: graph_flops(onnx_dir / f"{name}.onnx", dims(size, 2 if name == "transformer" else 1))
                for name in SUBMODULES}

    tables, notes = [], []
    # Per-submodule latency, one call each.
    f = flops(args.size)
    res = interleaved(variants, constants, {"job": "submodules", "height": args.size, "width": args.size},
                      args.reps, _log)
    rows = []
    for name in SUBMODULES:
        reference = [s[name] for s in res[ref]["samples"]]
        for v in variants:
            st = stats([s[name] for s in res[v.label]["samples"]], None if v.label == ref else reference)
            rows.append([name, v.label, f"{f[name] / 1e9:.1f}", f"{st.median * 1e3:.1f}",
                         st.ratio_text(), f"{st.median / (f[name] / rate):.2f}"])
    tables.append({"title": f"One call per submodule at {args.size}x{args.size} (transformer: one step, batch 2)",
                   "columns": ["submodule", "variant", "GFLOP", "median ms", "speed-up vs (a)", "x bound"],
                   "rows": rows})

    # End to end.
    rows = []
    for size, steps in ((args.size, args.steps), (args.large_size, args.large_steps)):
        if not size:
            continue
        f = flops(size)
        total = 2 * (f["text_encoder"] + f["text_encoder_2"] + f["text_encoder_3"]) + steps * f["transformer"] + f["vae_decoder"]
        res = interleaved(variants, constants, {"job": "e2e", "height": size, "width": size, "steps": steps},
                          args.reps, _log)
        reference = [s["seconds"] for s in res[ref]["samples"]]
        for v in variants:
            st = stats([s["seconds"] for s in res[v.label]["samples"]], None if v.label == ref else reference)
            rows.append([f"{size}x{size}, {steps} steps", v.label, f"{total / 1e12:.2f}", f"{st.median:.2f}",
                         st.ratio_text(), f"{st.median / (total / rate):.2f}", f"{res[v.label]['peak_rss_mib']:.0f}"])
    tables.append({"title": "End to end: prompt + negative prompt, guidance 7, VAE decode",
                   "columns": ["workload", "variant", "TFLOP", "median s", "speed-up vs (a)", "x bound", "peak RSS MiB"],
                   "rows": rows})

    # Export and build.
    rows = []
    for name, sub in onnx_manifest["submodules"].items():
        row = [name, f"{sub['export']['export_seconds']:.1f}", f"{sub['export']['seconds_with_checks']:.1f}",
               f"{sub['export']['bytes'] / 2**20:.0f}"]
        rows.append(row + [f"{read_manifest(a, verify=False)['submodules'][name]['build_seconds']:.1f}" for a in artifacts])
    tables.append({"title": "Export and build (seconds, as recorded in the manifests by the run that built them)",
                   "columns": ["submodule", "export s", "export + 2 parity checks s", "MiB",
                               *[f"build {a.name} s" for a in artifacts]], "rows": rows})

    report = {"command": command, "versions": package_versions(("torch", "diffusers", "transformers", "onnxruntime")),
              "model": src.entry.name, "description": src.entry.description, "reps": args.reps, "gemm": gemm,
              "tables": tables, "notes": notes}
    Path(args.out).write_text(render(report))
    _log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
