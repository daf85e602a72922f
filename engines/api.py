"""`build_artifact`: from <build>/onnx to a self-contained <build>/<target>-<precision> folder.

The artifact holds each submodule's engine, the tokenizers, the scheduler config and a
manifest the runner reads. It is built under a temporary name and renamed at the end, and
reused when the input graphs, the settings and the backend version are unchanged.
"""
from __future__ import annotations

import dataclasses
import inspect
import shutil
import time
from pathlib import Path

import onnx_ir as ir

from engines.calibration import CalibrationFeeds, CalibrationSettings, collect
from engines.calibration import describe as describe_calibration
from engines.passes import PASSES, PassContext, PassPipeline, check_pass_names
from engines.passes.ort_tools import request_session_options
from engines.precisions import RECIPES, Recipe
from engines.targets import BuildInput, BuildOptions, SubmoduleBuildFailed, TargetError, get_target
from runners.manifest import (
    MANIFEST, ManifestError, atomic_folder, digest, is_current, read_manifest, write_manifest,
)
from runners.provenance import WeightTable, table_path

ARTIFACT_FORMAT = 2  # bump when the artifact this code writes changes for the same inputs


def _log(msg: str) -> None:
    print(f"[engines] {msg}", flush=True)


def submodule_entry(export: dict, name: str) -> dict:
    """A submodule's artifact manifest entry as its builder reads it: its inputs, outputs and the
    min/opt/max of the dims they use, from the export's manifest."""
    sub, dims = export["submodules"][name], export["dims"]
    used = {d for t in sub["inputs"] + sub["outputs"] for d in t["shape"] if isinstance(d, str) and d in dims}
    return {"inputs": sub["inputs"], "outputs": sub["outputs"], "dims": {d: dims[d] for d in sorted(used)},
            "quantization": sub.get("quantization", {})}


def static_entry(entry: dict, dims: dict[str, int], constants: dict) -> dict:
    """A submodule entry narrowed to one shape per input: `dims` fixed, every other dim at its opt
    value; `static_shapes` records the shapes, which the runner holds every call to."""
    fixed = {d: dims.get(d, values[1]) for d, values in entry["dims"].items()}
    entry = {**entry, "dims": {d: [v, v, v] for d, v in fixed.items()}}
    shapes = BuildInput(None, "", entry, constants).input_shapes()
    return {**entry, "static_shapes": {name: opt for name, (_, opt, _) in shapes.items()}}


def passes_fingerprint(names: dict[str, list[str]]) -> str:
    """The pass lists and the code they run: the modules of the passes used, every module of
    engines/passes that holds no pass (the infrastructure they share) and, for the passes that
    plan memory, engines/memory. A changed pass rebuilds the artifacts that use it, and only those."""
    import engines.passes

    pass_files = {Path(inspect.getfile(cls)) for cls in PASSES.values()}
    used = {Path(inspect.getfile(PASSES[n])) for pipeline in names.values() for n in pipeline}
    shared = set(Path(engines.passes.__file__).parent.glob("*.py")) - pass_files
    if any(PASSES[n].plans_memory for pipeline in names.values() for n in pipeline):
        shared |= set((Path(engines.passes.__file__).parent.parent / "memory").glob("*.py"))
    return digest([names, sorted(p.read_text() for p in used | shared)])


def _recipe(source: dict, precision: str, onnx_dir: Path) -> Recipe:
    """The precision's passes. They turn float32 graphs into the precision; graphs exported in
    float16 are fp16 already and build as they are (and into nothing else: the quantizers and
    the fp16 converter start from float32)."""
    exported = source.get("dtype", "float32")
    if exported == "float32":
        return RECIPES[precision]
    if precision != "fp16":
        raise TargetError(f"{onnx_dir} was exported in {exported}: it builds --precision fp16 only. For "
                          f"{precision}, export in float32 (python -m export MODEL --dtype float32)")
    return Recipe(targets=RECIPES["fp16"].targets)


def build_artifact(build_dir: Path, target: str = "ort", precision: str = "fp32", force: bool = False,
                   passes: list[str] | None = None, calibration: CalibrationSettings = CalibrationSettings(),
                   options: BuildOptions = BuildOptions(), fallback: str | None = None,
                   memory: bool = False, memory_budget: int | None = None) -> Path:
    """Build `build_dir`/onnx into `build_dir`/`target`-`precision` and return that folder.

    `passes` replaces the target's own pass list (names from `engines.passes.PASSES`; [] for none);
    the precision's passes (`engines.precisions`) run after it. Precisions that measure the model
    first record `calibration` inputs from the fp32 artifact (`engines.calibration`). `options` are
    the engine builder's (TensorRT); `fallback="ort"` builds a submodule the target rejects for
    ONNX Runtime instead, and the manifest says which ran where. `memory=True` adds the target's
    memory profile (its passes last, planned at the export's opt shapes, down to `memory_budget`
    bytes when given, and the runtime settings that keep them) and writes `<target>-<precision>-memory`; a
    static TensorRT build (`options.static`) writes `<target>-<precision>-static`."""
    build_dir = Path(build_dir)
    tgt = get_target(target, precision)  # unknown target/precision, missing backend or GPU: fail first
    if fallback not in (None, "ort"):
        raise TargetError(f"unknown fallback '{fallback}'; the only fallback is 'ort'")
    ort_target = get_target("ort", precision) if fallback else None
    options = dataclasses.replace(options, cache_dir=options.cache_dir or build_dir / "engine-cache")
    static = options.static if tgt.build_options else None
    if tgt.build_options and options.cache_dir.exists() and not options.cache_dir.is_dir():
        raise TargetError(f"--engine-cache {options.cache_dir} is a file: give a folder (created if missing)")
    onnx_dir = build_dir / "onnx"
    if not (onnx_dir / MANIFEST).exists():
        raise ManifestError(f"{onnx_dir} has no {MANIFEST}: run `python -m export MODEL --out {build_dir}` first")
    source = read_manifest(onnx_dir)
    if static:
        try:
            static = static.resolved(source["pipeline"], source["dims"])
        except ValueError as e:
            raise TargetError(str(e)) from None
        options = dataclasses.replace(options, static=static)
    if memory and tgt.memory is None:
        raise TargetError(f"target '{target}' plans its own activation memory: --memory is for the ort target")
    if memory_budget is not None and not memory:
        raise TargetError("--memory-budget is a setting of --memory: add --memory")
    memory_passes = list(tgt.memory.passes) if memory else []
    base = check_pass_names(tgt.passes if passes is None else passes)
    # A target that takes the precision its own way (OpenVINO) runs no precision passes.
    recipe = _recipe(source, precision, onnx_dir).for_target(target)
    own = recipe.targets.get(target)
    pipelines = {name: PassPipeline(base + list(recipe.for_submodule(sub)) + memory_passes)
                 for name, sub in source["submodules"].items()}
    calibration_dir = None
    if any(p.needs_calibration for p in pipelines.values()) or (own and own.quantize):
        # The precision is measured on the fp32 ORT artifact's own engine calls: built first.
        calibration_dir = collect(build_artifact(build_dir, "ort", "fp32"), calibration)
    settings = {"target": target, "precision": precision, "backend": tgt.backend_version(),
                **({"build_options": options.settings(), "fallback": fallback} if tgt.build_options else {}),
                **({"memory": {"passes": memory_passes, "budget": memory_budget}} if memory else {}),
                **({"runtime": own.runtime} if own else {})}
    plan_dims = {**source["constants"], **{d: v[1] for d, v in source["dims"].items()}}
    cache_key = digest([ARTIFACT_FORMAT, source["files"], settings, calibration_dir and calibration_dir.name,
                        passes_fingerprint({n: p.names for n, p in pipelines.items()})])
    dest = build_dir / f"{target}-{precision}{'-memory' if memory else ''}{'-static' if static else ''}"
    if not force and is_current(dest, cache_key):
        _log(f"{dest} is up to date (same graphs, settings and {tgt.backend_module} version): reusing it")
        return dest
    with atomic_folder(dest) as tmp:
        submodules = {}
        for name, sub in source["submodules"].items():
            t0 = time.perf_counter()
            model = ir.load(onnx_dir / sub["file"])  # weights in external data stay on disk (memory-mapped)
            feeds = calibration_dir and CalibrationFeeds(calibration_dir, name)
            weights = WeightTable.load(table_path(onnx_dir / sub["file"]))
            context = PassContext(name, sub, feeds, plan_dims, memory_budget, weights)
            model, reports = pipelines[name](model, name, log=_log, context=context)
            if memory:
                request_session_options(model, **tgt.memory.options_for(name))
            entry = submodule_entry(source, name)
            if static:
                entry = static_entry(entry, static.dims(name, source["pipeline"]), source["constants"])
            built = BuildInput(model, name, entry, source["constants"], own, feeds, weights)
            try:
                files, record = tgt.build_submodule(built, tmp, options)
            except SubmoduleBuildFailed as e:
                if ort_target is None:
                    raise
                _log(f"{name}: {e}; building it for ONNX Runtime instead (--fallback ort)")
                files, record = ort_target.build_submodule(built, tmp, options)
                record = {**record, "target": "ort", "fallback_because": str(e)}
            del model, built
            if weights:  # the names of the engine's weights are the graph's (TensorRT's refit map too)
                if files[0].endswith(".onnx"):
                    weights.locate(tmp / files[0])
                weights.save(table_path(tmp / files[0]))
            size = sum((tmp / f).stat().st_size for f in files)
            seconds = round(time.perf_counter() - t0, 2)
            _log(f"{name}: {record.get('target', target)}-{precision} in {seconds:.1f} s, {size / 2**20:.1f} MiB")
            submodules[name] = {
                "file": files[0],
                **({"weights_file": table_path(tmp / files[0]).name} if weights else {}),
                **entry,
                "build_seconds": seconds,
                "passes": reports,
                **record,
            }
        for entry in list(source["tokenizers"].values()) + [source["scheduler"]]:
            (tmp / entry["file"]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(onnx_dir / entry["file"], tmp / entry["file"])
        write_manifest(tmp, {
            "stage": "artifact",
            "cache_key": cache_key,
            "exported_dtype": source.get("dtype", "float32"),
            "model": source["model"],
            **settings,
            "passes": base,
            **({"calibration": describe_calibration(calibration_dir)} if calibration_dir else {}),
            "pipeline": source["pipeline"],
            "dims": source["dims"],
            **({"static": static.record()} if static else {}),
            "constants": source["constants"],
            "tokenizers": source["tokenizers"],
            "scheduler": source["scheduler"],
            "submodules": submodules,
            "versions": {**source["versions"], tgt.backend_distributions[0]: tgt.backend_version()},
        })
    _log(f"wrote {dest}")
    return dest
