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
from runners.manifest import atomic_folder, exclusive, is_current, load_onnx, write_manifest
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
                   memory: bool = False, memory_budget: int | None = None) -> Path:
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
    `<target>-<precision>-static`."""
    return execute(plan(build_dir, target, precision, options=options, force=force, passes=passes,
                        calibration=calibration, fallback=fallback, memory=memory, memory_budget=memory_budget))


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
    with atomic_folder(p.dest) as tmp:
        submodules = {name: _build_submodule(p, name, tmp, recordings) for name in p.source["submodules"]}
        onnx_dir = p.build_dir / "onnx"
        for entry in list(p.source["tokenizers"].values()) + [p.source["scheduler"]]:
            (tmp / entry["file"]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(onnx_dir / entry["file"], tmp / entry["file"])
        write_manifest(tmp, artifact_manifest(p, submodules, recordings))
    _log(f"wrote {p.dest}")
    return p.dest


def _build_submodule(p: BuildPlan, name: str, tmp: Path, recordings: Path | None) -> dict:
    """Submodule `name` through its passes and the target's builder (or the fallback's, when the
    target rejects it): its manifest entry."""
    t0 = time.perf_counter()
    sub = p.source["submodules"][name]
    onnx_file = p.build_dir / "onnx" / sub["file"]
    model = load_onnx(onnx_file)  # weights in external data stay on disk (memory-mapped)
    feeds = recordings and CalibrationFeeds(recordings, name)
    weights = WeightTable.load(table_path(onnx_file))
    plan_dims = {**p.source["constants"], **{d: v[1] for d, v in p.source["dims"].items()}}
    context = PassContext(name, sub, feeds, plan_dims, p.memory_budget, weights)
    model, reports = PassPipeline(p.passes[name])(model, name, log=_log, context=context)
    if p.memory is not None:
        request_session_options(model, **p.target.memory.options_for(name))
    entry = p.entry(name)
    built = BuildInput(model, name, entry, p.source["constants"], p.own, feeds, weights)
    try:
        files, record = p.target.build_submodule(built, tmp, p.options)
    except SubmoduleBuildFailed as e:
        if p.fallback is None:
            raise
        _log(f"{name}: {e}; building it for ONNX Runtime instead (--fallback ort)")
        files, record = p.fallback.build_submodule(built, tmp, p.fallback.options())
        record = {**record, "target": p.fallback.name, "backend": p.fallback.backend, "fallback_because": str(e)}
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
