"""The memory table: a VAE submodule at a large size, each run in a fresh process, ONNX Runtime's
defaults on the plain export against the `--memory` artifact with the settings its manifest
records, and the static analyzer's planned peak against the measured increase in RSS."""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from bench.harness import in_child, in_prepared_child, log
from bench.tables import Table
from bench.tables.passes import what_changed
from bench.workload import call_dims
from runners.manifest import load_onnx, read_manifest


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def run_once(path: str, inputs: dict[str, tuple], config: dict | None, options: dict | None) -> dict:
    """One call of the graph at `path` in this (fresh) process on random `inputs` ({name: shape},
    float32). `options` None: ONNX Runtime's own defaults; else the runner's session with these
    session config entries and options."""
    import numpy as np
    import onnxruntime as ort

    if options is None:
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    else:
        from runners.backends.ort import OrtSession

        session = OrtSession(path, session_config=config, session_options=options).session
    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in inputs.items()}
    before = _rss_mib("VmRSS")
    t0 = time.perf_counter()
    session.run(None, feeds)
    seconds = time.perf_counter() - t0
    peak = _rss_mib("VmHWM")
    return {"seconds": seconds, "peak_mib": peak, "increase_mib": peak - before}


def planned_peak_mib(path: Path, dims: dict) -> float:
    from engines.memory.graph import load_graph
    from engines.memory.planner import plan

    return plan(load_graph(path, dims)).peak / 2**20


def graph_without(onnx_dir: Path, artifact: Path, submodule: str, drop: str, out_dir: Path) -> str:
    """The artifact's graph of `submodule` rebuilt from the export with the same passes, at the
    same planning dims, but `drop`: what that one pass changes can then be measured alone."""
    import onnx_ir as ir

    from engines.passes import PassContext, PassPipeline

    source, built = read_manifest(onnx_dir, verify=False), read_manifest(artifact, verify=False)
    names = [r["name"] for r in built["submodules"][submodule]["passes"] if r["name"] != drop]
    dims = {**source["constants"], **{d: v[1] for d, v in source["dims"].items()}}
    context = PassContext(submodule, source["submodules"][submodule], None, dims, built["memory"]["budget"])
    model, _ = PassPipeline(names)(load_onnx(onnx_dir / source["submodules"][submodule]["file"]), submodule,
                                   context=context)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{submodule}.onnx"
    ir.save(model, path, external_data=f"{submodule}.onnx.data")
    return str(path)


def graph_gflops(path: str, dims: dict) -> float:
    from engines.memory.graph import graph_flops

    return graph_flops(Path(path), dims) / 1e9


def measure(run) -> list[dict]:
    """--memory-submodules at --memory-size and --memory-batch: ONNX Runtime's defaults on the
    plain export and on the default artifact, against the --memory artifact with and without
    remat, every run in a fresh process; and the analyzer's planned peak against the RSS
    increase measured with buffer reuse and the arena off."""
    from bench.prepare import build_memory
    from export.shapes import concrete

    a, default = run.args, run.default_artifact
    artifact = in_prepared_child(build_memory, run.build)
    built = read_manifest(artifact, verify=False)
    manifest = built["submodules"]
    size, batch = a.memory_size, a.memory_batch
    dims = call_dims(run.src, run.constants, size, batch)
    names = a.memory_submodules.split(",")
    rows = []
    med = statistics.median
    for name in names:
        sub = manifest[name]
        inputs = {t["name"]: concrete(tuple(t["shape"]), dims, run.constants) for t in sub["inputs"]}
        weights = sum(f.stat().st_size for f in run.onnx_dir.glob(f"{name}.onnx*")) / 2**20
        config, options = sub.get("session_config", {}), sub.get("session_options", {})
        no_reuse = {**options, "enable_cpu_mem_arena": False, "enable_mem_reuse": False}
        no_layout = {**no_reuse, "disabled_optimizers": options.get("disabled_optimizers", []) + ["NchwcTransformer"]}
        graphs = {"plain": str(run.onnx_dir / f"{name}.onnx"), "default": str(default / manifest[name]["file"])}
        remat = next((p for p in sub["passes"] if p["name"] == "remat"), None)
        if remat and remat["modified"]:
            graphs["no_remat"] = in_prepared_child(graph_without, run.onnx_dir, artifact, name, "remat",
                                          run.build / "bench-memory-no-remat")
        graphs["memory"] = str(artifact / sub["file"])
        settings = {"plain": (None, None), "default": (None, None), "no_remat": (config, options),
                    "memory": (config, options)}
        labels = {"plain": "plain export, ONNX Runtime defaults",
                  "default": f"{default.name} (fusions), ONNX Runtime defaults",
                  "no_remat": f"{artifact.name} without remat, its manifest's settings",
                  "memory": f"{artifact.name}, its manifest's settings"}
        # The static figures first: a failure here costs seconds, not the runs' minutes.
        planned = {key: in_child(planned_peak_mib, Path(path), dims) for key, path in graphs.items()}
        gflops = {key: in_child(graph_gflops, path, dims) for key, path in graphs.items()}
        runs = {key: [] for key in graphs}
        for rep in range(a.reps):  # interleaved, each in a fresh process
            for key, path in graphs.items():
                runs[key].append(in_child(run_once, path, inputs, *settings[key]))
            log(f"memory {name} {size}x{size} batch {batch}: {rep + 1}/{a.reps}")
        check = {"reuse and arena off": in_child(run_once, graphs["memory"], inputs, config, no_reuse),
                 "reuse, arena and NCHWc layout off": in_child(run_once, graphs["memory"], inputs, config, no_layout)}
        ref = med([r["peak_mib"] for r in runs["default"]])
        for key in graphs:
            peak, sec = med([r["peak_mib"] for r in runs[key]]), med([r["seconds"] for r in runs[key]])
            rows.append([name, labels[key], f"{peak:.0f}", f"{peak - weights:.0f}",
                         f"{(peak - weights) / (ref - weights):.2f}", f"{sec:.1f}",
                         f"{gflops[key]:.0f} ({gflops[key] / gflops['default'] - 1:+.1%})",
                         f"{planned[key]:.0f}", "-"])
        for label, r in check.items():
            rows.append([name, f"{artifact.name}, {label}", f"{r['peak_mib']:.0f}", f"{r['peak_mib'] - weights:.0f}",
                         "-", f"{r['seconds']:.1f}", "-", f"{planned['memory']:.0f}",
                         f"{r['increase_mib']:.0f} ({r['increase_mib'] / planned['memory'] - 1:+.0%})"])
    passes = {n: [p for p in manifest[n]["passes"] if p["name"] in built["memory"]["passes"]] for n in names}
    return [{
        "title": f"Activation memory: {', '.join(names)} of {run.src.entry.name} at {size}x{size}, batch {batch} (fp32)",
        "columns": ["submodule", "graph and session", "peak RSS MiB", "above the weights MiB",
                    f"vs {default.name}", "seconds", "GFLOP (vs fusions)",
                    "analyzer's planned peak MiB", "measured RSS increase MiB (vs planned)"],
        "rows": rows,
        "notes": [f"Medians of {a.reps} runs, each in a fresh process that loads one graph and runs it once; "
                  "peak RSS is that process's VmHWM (weights and ONNX Runtime's prepacked copies included). "
                  "'Above the weights' is that peak minus the bytes of the exported weights file(s): the "
                  "activations and whatever ONNX Runtime allocates besides. The increase is VmHWM minus the RSS "
                  "just before the call. The analyzer plans the graph's file order (ONNX Runtime's default "
                  "order may differ on the plain export).",
                  "Memory passes as the artifact's manifest records them: " + "; ".join(
                      f"{n}: " + what_changed(ps) for n, ps in passes.items()),
                  "Session settings of the artifact: " + "; ".join(
                      f"{n}: {manifest[n].get('session_options', {})}" for n in names)]}]


def _arguments(group) -> None:
    group.add_argument("--memory-size", type=int, default=1024, help="image side of the memory table's runs")
    group.add_argument("--memory-batch", type=int, default=1, help="batch of the memory table's runs")
    group.add_argument("--memory-submodules", default="vae_decoder,vae_encoder",
                       help="the submodules of the memory table (sd15-bench: unet)")


# `make bench` measures it on sd3-bench and sd15-bench. Not sdxl: its memory artifact's U-Net build
# costs the smoke test minutes, and the table's code is the same for both U-Net families.
TABLE = Table("memory", "Activation memory", "ort-fp32 with the memory profile (`--memory`)", ("sd3", "sd15"),
              measure, _arguments, smoke=("--memory-size", "128", "--memory-submodules", "vae_decoder"))
