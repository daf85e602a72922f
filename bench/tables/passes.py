"""The transformer graphs the pass table compares: our export through different pass lists, ONNX
Runtime's own transformer optimizer (`mmdit`) on our export, and Optimum's export.

Each of ours is built by the ORT target itself (passes, then `build_submodule`), cached by the
input graph and the passes' code, and written complete or not at all."""
from __future__ import annotations

from pathlib import Path

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


def _log(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def build_with_passes(onnx_dir: Path, out_root: Path, submodule: str,
                      labels: list[str] | None = None) -> dict[str, tuple[Path, list]]:
    """label -> (graph path, pass reports), one folder per pass list under `out_root` (the lists
    of `pass_lists()`, or only `labels`)."""
    import onnx_ir as ir

    from engines.api import passes_fingerprint, submodule_entry
    from engines.passes import run_passes
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
            _log(f"{submodule} with passes [{', '.join(names)}]")
            with atomic_folder(dest) as tmp:
                model, reports = run_passes(ir.load(onnx_dir / f"{submodule}.onnx"), names, submodule)
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
        _log(f"{submodule} through onnxruntime.transformers.optimizer (model_type={model_type})")
        logging.getLogger("onnxruntime.tools.symbolic_shape_infer").setLevel(logging.ERROR)
        with atomic_folder(dest) as tmp:
            model = optimize_model(str(onnx_dir / f"{submodule}.onnx"), model_type=model_type)
            fused = {k: v for k, v in model.get_fused_operator_statistics().items() if v}
            model.save_model_to_file(str(tmp / f"{submodule}.onnx"),
                                     use_external_data_format=model.model.ByteSize() > 2**31)
            write_manifest(tmp, {"cache_key": key, "fused": fused})
    return dest / f"{submodule}.onnx", read_manifest(dest, verify=False)["fused"]


def op_profile(graph: Path, constants: dict, size: int) -> dict[str, float]:
    """Seconds per op type of one transformer step in steady state: the runner's profiling session
    (`runners.backends.ort`), two calls, the second one read."""
    from bench.variants import submodule_inputs
    from runners.backends.ort import OrtSession
    from runners.profile import ort_runs

    feeds = submodule_inputs(constants, size, size)[graph.stem]
    session = OrtSession(graph, profile=True)
    session.run(feeds)
    session.run(feeds)
    _, kernels = ort_runs(session.end_profiling())[-1]
    per_op: dict[str, float] = {}
    for e in kernels:
        per_op[e["args"]["op_name"]] = per_op.get(e["args"]["op_name"], 0.0) + e["dur"] / 1e6
    return dict(sorted(per_op.items(), key=lambda kv: -kv[1]))
