"""`build_artifact`: from <build>/onnx to a self-contained <build>/<target>-<precision> folder.

The artifact holds each submodule's engine, the tokenizers, the scheduler config and a
manifest the runner reads. It is built under a temporary name and renamed at the end, and
reused when the input graphs, the settings and the backend version are unchanged. A build is
a plan (`engines.plan`: what will be built, pure) and its execution (`execute`, here).
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from engines.calibration import CalibrationFeeds, CalibrationSettings, collect
from engines.calibration import describe as describe_calibration
from engines.passes import PassContext, PassPipeline
from engines.passes.ort_tools import request_session_options
from engines.plan import BuildPlan, passes_fingerprint, plan, submodule_entry
from engines.targets import BuildInput, SubmoduleBuildFailed, TargetOptions, target_options
from runners.manifest import atomic_folder, exclusive, is_current, load_onnx, read_manifest, write_manifest
from runners.adapters.provenance import WeightTable, table_path

# plan and target_options are the Python API's, as the CLI's --dry-run and target flags;
# passes_fingerprint and submodule_entry serve bench/passes.py.
__all__ = ["BuildPlan", "artifact_manifest", "build_artifact", "execute", "passes_fingerprint", "plan",
           "submodule_entry", "target_options"]


def _log(msg: str) -> None:
    print(f"[engines] {msg}", flush=True)


def build_artifact(build_dir: Path, target: str = "ort", precision: str = "fp32", force: bool = False,
                   passes: list[str] | None = None, calibration: CalibrationSettings = CalibrationSettings(),
                   options: TargetOptions | None = None, fallback: str | None = None,
                   memory: bool = False, memory_budget: int | None = None, remove_export: bool = False) -> Path:
    """Build `build_dir`/onnx into `build_dir`/`target`-`precision` and return that folder.

    `passes` replaces the target's own pass list (names from `engines.passes.PASSES`; [] for none);
    the precision's passes (`engines.precisions`) run after it. Precisions that measure the model
    first record `calibration` inputs from the fp32 artifact (`engines.calibration`). `options` are
    the target's own (its `Target.options` class, e.g. `engines.targets.trt.TrtOptions`; from keywords:
    `target_options(target, **kwargs)`; None: its defaults); another target's are refused.
    `fallback="ort"` builds a submodule the target rejects for ONNX Runtime instead, and the manifest
    says which ran where. `memory=True` adds the target's memory profile (its passes last, planned at
    the export's opt shapes, down to `memory_budget` bytes when given, and the runtime settings that
    keep them) and writes `<target>-<precision>-memory`; a static TensorRT build writes
    `<target>-<precision>-static`. `remove_export=True` deletes each submodule's exported graph and weights as
    soon as its build has read them: the export cannot be built again."""
    return execute(plan(build_dir, target, precision, options=options, force=force, passes=passes,
                        calibration=calibration, fallback=fallback, memory=memory, memory_budget=memory_budget,
                        remove_export=remove_export))


def execute(p: BuildPlan) -> Path:
    """Carry out the plan `p`: its calibration first (the fp32 artifact's plan executed, then recorded),
    then every submodule's passes and engine, the tokenizers and scheduler, and the manifest."""
    with exclusive(p.dest):  # a build of the same artifact elsewhere finishes first, then this reuses it
        if p.up_to_date or (not p.forced and is_current(p.dest, p.cache_key)):  # or made while this one waited
            _log(f"{p.dest} is up to date (same graphs, settings and {p.target.backend_module} version): reusing it")
            return p.dest
        return _write(p)


def _write(p: BuildPlan) -> Path:
    recordings = p.calibration and collect(execute(p.calibration.artifact), p.calibration.settings)
    assert not recordings or recordings == p.calibration.folder, (recordings, p.calibration.folder)
    fp32 = p.prepared
    prepared = fp32 and is_current(fp32.dest, fp32.cache_key) and read_manifest(fp32.dest, verify=False)
    if prepared:
        _log(f"target passes ({', '.join(p.base)}): taking their graphs from {p.prepared.dest}")
    with atomic_folder(p.dest) as tmp:
        submodules = {name: _build_submodule(p, name, tmp, recordings, prepared) for name in p.source["submodules"]}
        onnx_dir = p.build_dir / "onnx"
        for entry in list(p.source["tokenizers"].values()) + [p.source["scheduler"]]:
            (tmp / entry["file"]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(onnx_dir / entry["file"], tmp / entry["file"])
        write_manifest(tmp, artifact_manifest(p, submodules, recordings))
    _log(f"wrote {p.dest}")
    return p.dest


def _start(p: BuildPlan, name: str, prepared: dict | None):
    """(graph, weight table, reports of the passes already run, the passes left, the export's graph file or None)
    of submodule `name`: the export's graph with all its passes to run, or the prepared artifact's (`prepared`: its
    manifest), which ran the target passes on the same graph (fold_constants and infer_shapes alone take minutes on
    a real-size one). Weights in external data stay on disk (memory-mapped)."""
    names, done = p.passes[name], prepared and prepared["submodules"][name]["passes"]
    if done and [r["name"] for r in done] == p.base == names[:len(p.base)]:
        graph = p.prepared.dest / prepared["submodules"][name]["file"]
        weights = WeightTable.load(table_path(graph))
        weights.unlocate()  # where the weights are in that artifact's files is that artifact's
        reused = [{**r, "reused_from": p.prepared.dest.name} for r in done]
        return load_onnx(graph), weights, reused, names[len(p.base):], None
    onnx_file = p.build_dir / "onnx" / p.source["submodules"][name]["file"]
    return load_onnx(onnx_file), WeightTable.load(table_path(onnx_file)), [], names, onnx_file


def _remover(p: BuildPlan, name: str, onnx_file: Path | None):
    """What a target calls once it has read submodule `name`'s weights (`BuildInput.source_read`): with
    `--remove-export`, deletes its exported graph, weights and weight table (the export's data is then freed as
    the build's own files are written, where a real-size model's would not fit beside them); else nothing."""
    def remove() -> None:
        if p.remove_export and onnx_file is not None and onnx_file.exists():
            for path in (onnx_file, onnx_file.with_name(f"{onnx_file.name}.data"), table_path(onnx_file)):
                path.unlink(missing_ok=True)
            _log(f"{name}: removed its export ({onnx_file.name}), read")

    return remove


def _build_submodule(p: BuildPlan, name: str, tmp: Path, recordings: Path | None, prepared: dict | None) -> dict:
    """Submodule `name` through its passes and the target's builder (or the fallback's, when the
    target rejects it): its manifest entry."""
    t0 = time.perf_counter()
    sub = p.source["submodules"][name]
    model, weights, reports, left, onnx_file = _start(p, name, prepared)
    feeds = recordings and CalibrationFeeds(recordings, name)
    plan_dims = {**p.source["constants"], **{d: v[1] for d, v in p.source["dims"].items()}}
    context = PassContext(name, sub, feeds, plan_dims, p.memory_budget, weights)
    model, run = PassPipeline(left)(model, name, log=_log, context=context)
    reports += run
    if p.memory is not None:
        request_session_options(model, **p.target.memory.options_for(name))
    entry = p.entry(name)
    source_read = _remover(p, name, onnx_file)
    built = BuildInput(model, name, entry, p.source["constants"], p.own, feeds, weights, source_read)
    try:
        files, record = p.target.build_submodule(built, tmp, p.options)
    except SubmoduleBuildFailed as e:
        if p.fallback is None:
            raise
        _log(f"{name}: {e}; building it for ONNX Runtime instead (--fallback ort)")
        files, record = p.fallback.build_submodule(built, tmp, p.fallback.options())
        record = {**record, "target": p.fallback.name, "backend": p.fallback.backend, "fallback_because": str(e)}
    source_read()  # the targets that do not say when they have read it: once built
    del model, built
    if weights:  # the names of the engine's weights are the graph's (TensorRT's refit map too)
        if files[0].endswith(".onnx"):
            weights.locate(tmp / files[0])
        weights.save(table_path(tmp / files[0]))
    size = sum((tmp / f).stat().st_size for f in files)
    seconds = round(time.perf_counter() - t0, 2)
    _log(f"{name}: {record.get('target', p.target.name)}-{p.precision} in {seconds:.1f} s, {size / 2**20:.1f} MiB")
    return {"file": files[0], **({"weights_file": table_path(tmp / files[0]).name} if weights else {}),
            **entry, "build_seconds": seconds, "passes": reports, **record}


def artifact_manifest(p: BuildPlan, submodules: dict, recordings: Path | None) -> dict:
    """The artifact's manifest (the runner's contract), without the files, which write_manifest lists."""
    source = p.source
    return {
        "stage": "artifact",
        "cache_key": p.cache_key,
        "exported_dtype": source.get("dtype", "float32"),
        "model": source["model"],
        **p.settings,
        "passes": p.base,
        **({"calibration": describe_calibration(recordings)} if recordings else {}),
        "pipeline": source["pipeline"],
        "dims": source["dims"],
        **p.options.record(),
        "constants": source["constants"],
        "tokenizers": source["tokenizers"],
        "scheduler": source["scheduler"],
        "submodules": submodules,
        "versions": {**source["versions"], p.target.backend_distributions[0]: p.target.backend_version()},
    }
