"""The pass table: the denoiser's step through different pass lists of ours, against ONNX Runtime's
own transformer optimizer (`mmdit`) on our export and against Optimum's export.

Each of our graphs is built by the ORT target itself (passes, then `build_submodule`), cached by
the input graph and the passes' code, and written complete or not at all."""
from __future__ import annotations

from pathlib import Path

from bench.harness import Variant, against_first, in_prepared_child, interleaved_fresh, log
from bench.tables import Table
from engines.targets import get_target

CLEANUP = ["fold_constants", "infer_shapes", "remove_dead_nodes"]


def pass_lists() -> dict[str, list[str]]:
    """Label -> pass list: without any pass, then each fusion added alone, then the target's list."""
    default = list(get_target("ort", "fp32").passes)
    return {
        "no passes": [],
        "clean-up": CLEANUP,
        "clean-up + fuse_qkv": CLEANUP + ["fuse_qkv"],
        "clean-up + fuse_attention": CLEANUP + ["fuse_attention"],
        "all (ort default)": default,
    }


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in label).strip("-")


def build_with_passes(onnx_dir: Path, out_root: Path, submodule: str,
                      labels: list[str] | None = None) -> dict[str, tuple[Path, list]]:
    """label -> (graph path, pass reports), one folder per pass list under `out_root` (the lists
    of `pass_lists()`, or only `labels`)."""
    from engines.api import passes_fingerprint, submodule_entry
    from engines.passes import run_passes
    from runners.manifest import load_onnx
    from engines.targets import BuildInput
    from runners.manifest import atomic_folder, digest, is_current, read_manifest, write_manifest

    export = read_manifest(onnx_dir, verify=False)
    target = get_target("ort", "fp32")
    out = {}
    for label, names in pass_lists().items():
        if labels is not None and label not in labels:
            continue
        dest = out_root / _slug(label)
        key = digest([export["files"][f"{submodule}.onnx"], passes_fingerprint({submodule: names})])
        if not is_current(dest, key):
            log(f"{submodule} with passes [{', '.join(names)}]")
            with atomic_folder(dest) as tmp:
                model, reports = run_passes(load_onnx(onnx_dir / f"{submodule}.onnx"), names, submodule)
                built = BuildInput(model, submodule, submodule_entry(export, submodule), export["constants"])
                files, _ = target.build_submodule(built, tmp, target.options())
                write_manifest(tmp, {"cache_key": key, "passes": reports, "file": files[0]})
        record = read_manifest(dest, verify=False)
        out[label] = (dest / record["file"], record["passes"])
    return out


def ort_optimizer(onnx_dir: Path, out_root: Path, submodule: str, model_type: str) -> tuple[Path, dict]:
    """ONNX Runtime's transformer optimizer on our export; returns the graph and what it fused."""
    import logging

    from onnxruntime.transformers.optimizer import optimize_model

    from runners.manifest import atomic_folder, digest, is_current, read_manifest, write_manifest

    source = read_manifest(onnx_dir, verify=False)["files"][f"{submodule}.onnx"]
    dest = out_root / f"ort-optimizer-{model_type}"
    key = digest([source, model_type])
    if not is_current(dest, key):
        log(f"{submodule} through onnxruntime.transformers.optimizer (model_type={model_type})")
        logging.getLogger("onnxruntime.tools.symbolic_shape_infer").setLevel(logging.ERROR)
        with atomic_folder(dest) as tmp:
            model = optimize_model(str(onnx_dir / f"{submodule}.onnx"), model_type=model_type)
            fused = {k: v for k, v in model.get_fused_operator_statistics().items() if v}
            model.save_model_to_file(str(tmp / f"{submodule}.onnx"),
                                     use_external_data_format=model.model.ByteSize() > 2**31)
            write_manifest(tmp, {"cache_key": key, "fused": fused})
    return dest / f"{submodule}.onnx", read_manifest(dest, verify=False)["fused"]


def op_profile(graph: Path, inputs: dict) -> dict[str, float]:
    """Seconds per op type of one step of the graph in steady state, on `inputs` (bench.workload's
    specs): the runner's profiling session (`runners.backends.ort`), two calls, the second one read."""
    from bench.workload import make_inputs
    from runners.backends.ort import OrtSession
    from runners.profile import ort_runs

    feeds = make_inputs(inputs)[graph.stem]
    session = OrtSession(graph, profile=True)
    session.run(feeds)
    session.run(feeds)
    _, kernels = ort_runs(session.end_profiling())[-1]
    per_op: dict[str, float] = {}
    for e in kernels:
        per_op[e["args"]["op_name"]] = per_op.get(e["args"]["op_name"], 0.0) + e["dur"] / 1e6
    return dict(sorted(per_op.items(), key=lambda kv: -kv[1]))


def what_changed(reports: list[dict]) -> str:
    """The counts of the passes that modified a graph, from their reports."""
    done = [f"{r['name']}: " + ", ".join(f"{k} {v}" for k, v in r["counts"].items() if v)
            for r in reports if r["modified"]]
    return "; ".join(done) or "nothing (no passes)"


def measure(run) -> list[dict]:
    a, root, name = run.args, run.build / "passes", run.denoiser
    graphs = in_prepared_child(build_with_passes, run.onnx_dir, root, name)
    variants = [Variant(f"ours, {label}", "graph", str(path)) for label, (path, _) in graphs.items()]
    changed = {f"ours, {label}": what_changed(reports) for label, (_, reports) in graphs.items()}
    path, fused = in_prepared_child(ort_optimizer, run.onnx_dir, root, name, "mmdit")
    variants.append(Variant("ONNX Runtime optimizer (mmdit) on our export", "graph", str(path)))
    changed[variants[-1].label] = ", ".join(f"{k} {v}" for k, v in fused.items()) or "fused nothing"
    if run.optimum_folder is not None:
        variants.append(Variant("Optimum-ONNX export", "graph", str(run.optimum_folder / name / "model.onnx")))
        changed[variants[-1].label] = "legacy exporter, no ORT optimizer"
    job = {"job": "submodules", "inputs": run.inputs(a.size, [name]), "calls": 3, "height": a.size, "width": a.size}
    # One graph in memory at a time (seven of them and their arenas do not fit side by side), each
    # timed in steady state after a warm-up call, as in the denoising loop.
    samples, peaks, failed = interleaved_fresh(variants, run.constants, job, a.reps, log, warmup=True)
    if failed:
        raise RuntimeError(f"pass table: {'; '.join(failed.values())}")
    flops = run.flops(a.size)[name]
    rows = [[v.label, changed[v.label], f"{st.median * 1e3:.0f}", ratio, f"{st.median / (flops / run.rate):.2f}",
             f"{peaks[v.label]:.0f}"]
            for v, st, ratio in against_first(variants, samples, lambda s: s[name])]
    return [{
        "title": f"{name.capitalize()} step by graph pass at {a.size}x{a.size}, batch 2 ({flops / 1e9:.1f} GFLOP)",
        "columns": ["graph", "what the passes did", "median ms", "speed-up vs no passes", "x bound", "peak RSS MiB"],
        "rows": rows,
        "notes": ["Each graph runs in the runner's ONNX Runtime session (CPU, memory pattern off), so only the "
                  "graph differs. Every repetition starts a fresh process, makes one untimed warm-up call and "
                  "takes the median of the next three; the graphs take turns (A B C ... A B C ...)."]}]


# ONNX Runtime's optimizer is run with its MMDiT model type: SD3 only.
TABLE = Table("passes", "Transformer step by graph pass", "the denoiser through 5 pass lists and ONNX Runtime's "
              "optimizer", ("sd3",), measure)
