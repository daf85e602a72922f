"""What a build will do, worked out before anything is built. `plan(...)` reads the export's manifest
and returns a `BuildPlan`: the settings, the cache key, the destination and whether it is up to date,
each submodule's pass list, and the calibration the precision needs, with the plan of the fp32
ONNX Runtime artifact it measures. It writes nothing: `engines.api.execute` carries a plan out, and
`python -m engines BUILD --dry-run` prints it (`describe`).
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from pathlib import Path

from engines.calibration import CalibrationSettings, recordings_folder
from engines.passes import PASSES, PassPipeline, check_pass_names
from engines.precisions import RECIPES, Recipe, TargetRecipe
from engines.targets import Target, TargetError, TargetOptions, get_target, refuse_foreign
from runners.manifest import MANIFEST, ManifestError, digest, is_current, read_manifest

ARTIFACT_FORMAT = 5  # bump when the artifact this code writes changes for the same inputs


@dataclass(frozen=True)
class Calibration:
    """The recordings a precision measures the model on: the engine calls of the fp32 ONNX Runtime
    artifact (`artifact`, built first when it is not up to date) over the calibration prompts."""

    artifact: BuildPlan
    settings: CalibrationSettings
    folder: Path  # where engines.calibration.collect keeps them


@dataclass(frozen=True)
class BuildPlan:
    build_dir: Path
    target: Target
    precision: str
    options: TargetOptions  # the target's own, resolved for this export
    source: dict  # the export's manifest
    passes: dict[str, list[str]]  # {submodule: every pass run on it, in order}
    base: list[str]  # the target's passes (or the caller's), before the precision's
    own: TargetRecipe | None  # the precision as the target takes it its own way
    memory: tuple[str, ...] | None  # the memory passes of `--memory`; None without it
    memory_budget: int | None
    fallback: Target | None  # builds the submodules the target rejects (`--fallback ort`)
    calibration: Calibration | None
    settings: dict  # what the manifest records of the build and the cache key holds
    cache_key: str
    dest: Path
    up_to_date: bool  # `dest` holds this cache key (and no rebuild was forced)
    forced: bool = False  # built again even when `dest` holds this cache key
    # The fp32 ONNX Runtime artifact whose graphs are this build's after `base` (the same target passes on
    # the same export): when it is up to date, the build starts from its graphs instead of running them again.
    prepared: BuildPlan | None = None
    # `--remove-export`: each submodule's exported graph and weights are deleted once its build has read them
    # (a real-size model whose export and artifact do not fit on the disk together); not a setting
    remove_export: bool = False

    def entry(self, name: str) -> dict:
        """Submodule `name`'s artifact manifest entry, as the target's options build it."""
        return self.options.entry(name, submodule_entry(self.source, name), self.source)


def submodule_entry(export: dict, name: str) -> dict:
    """A submodule's artifact manifest entry as its builder reads it: its inputs, outputs and the
    min/opt/max of the dims they use, from the export's manifest."""
    sub, dims = export["submodules"][name], export["dims"]
    used = {d for t in sub["inputs"] + sub["outputs"] for d in t["shape"] if isinstance(d, str) and d in dims}
    return {"inputs": sub["inputs"], "outputs": sub["outputs"], "dims": {d: dims[d] for d in sorted(used)},
            "quantization": sub.get("quantization", {})}


def export_read(source: dict) -> dict:
    """What of the export's manifest a build reads or copies, the cache key's part: all of it (the
    files' checksums, the constants, dims, pipeline settings, tokenizers, each submodule's tensors and
    quantization hints...) but the export's own cache key and each submodule's record of how its
    export went (seconds, peak memory, parity errors), which a re-export of the same model changes."""
    return {**{k: v for k, v in source.items() if k != "cache_key"},
            "submodules": {name: {k: v for k, v in sub.items() if k != "export"}
                           for name, sub in source["submodules"].items()}}


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


def builder_fingerprint(target: Target) -> str:
    """The code that builds the target's engines: its builder's module and the private modules beside it
    that serve it (engines/targets/_<module>_*.py: OpenVINO's quantizer and weight compression). A changed
    builder rebuilds that target's artifacts, as a changed pass rebuilds those that use it."""
    module = Path(inspect.getfile(target.build_submodule))
    return digest([p.read_text() for p in [module, *sorted(module.parent.glob(f"_{module.stem}_*.py"))]])


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
    return Recipe()


def _source(build_dir: Path) -> dict:
    onnx_dir = build_dir / "onnx"
    if not (onnx_dir / MANIFEST).exists():
        raise ManifestError(f"{onnx_dir} has no {MANIFEST}: run `python -m export MODEL --out {build_dir}` first")
    return read_manifest(onnx_dir)


def _options(target: Target, options: TargetOptions | None) -> TargetOptions:
    """The target's own options (its defaults for None); another target's are refused."""
    if options is None:
        return target.options()
    if type(options) is not target.options:
        refuse_foreign(target, {type(options): [type(options).__name__]})
    return options


def _pass_lists(target: Target, precision: str, source: dict, onnx_dir: Path, base: list[str],
                memory: tuple[str, ...] | None) -> dict[str, list[str]]:
    """{submodule: its passes}: the target's, the precision's (none where the target takes the precision
    its own way), then the memory passes, last so that the order they plan is the one that runs."""
    recipe = Recipe() if precision in target.own_precisions else _recipe(source, precision, onnx_dir)
    return {name: check_pass_names([*base, *recipe.for_submodule(sub), *(memory or ())])
            for name, sub in source["submodules"].items()}


def plan(build_dir: Path, target: str = "ort", precision: str = "fp32", *, options: TargetOptions | None = None,
         force: bool = False, passes: list[str] | None = None, calibration: CalibrationSettings = CalibrationSettings(),
         fallback: str | None = None, memory: bool = False, memory_budget: int | None = None,
         remove_export: bool = False) -> BuildPlan:
    """The plan of building `build_dir`/onnx for `target` at `precision` (see `engines.api.build_artifact`
    for the arguments). Every refusal happens here, before anything is built."""
    build_dir = Path(build_dir)
    tgt = get_target(target, precision)  # unknown target/precision, missing backend or GPU: fail first
    if fallback not in (None, "ort") or fallback == target:
        raise TargetError(f"--fallback {fallback} on target '{target}': the only fallback is 'ort', for the other "
                          "targets")
    fallback_target = get_target(fallback, precision) if fallback else None
    options = _options(tgt, options)
    source = _source(build_dir)
    options = options.resolved(build_dir, source, precision)
    if memory and tgt.memory is None:
        raise TargetError(f"target '{target}' plans its own activation memory: --memory is for the ort target")
    if memory_budget is not None and not memory:
        raise TargetError("--memory-budget is a setting of --memory: add --memory")
    memory_passes = tgt.memory.passes if memory else None
    base = check_pass_names(tgt.passes if passes is None else passes)
    lists = _pass_lists(tgt, precision, source, build_dir / "onnx", base, memory_passes)
    own = tgt.own_precisions.get(precision)
    calibrated = None
    if any(PassPipeline(names).needs_calibration for names in lists.values()) or (own and own.quantize):
        fp32 = plan(build_dir, "ort", "fp32")  # the precision is measured on this artifact's own engine calls
        # The size resolved, so that leaving it out and naming it are the same recordings.
        sized = dataclasses.replace(calibration, size=calibration_size(calibration, source))
        calibrated = Calibration(fp32, sized, recordings_folder(fp32.dest, fp32.cache_key, sized))
    settings = {"target": target, "precision": precision, "backend": tgt.backend,
                "backend_version": tgt.backend_version(),
                **({"build_options": options.settings()} if options.settings() else {}),
                **({"fallback": fallback} if fallback else {}),
                **({"memory": {"passes": list(memory_passes), "budget": memory_budget}} if memory else {}),
                **({"runtime": own.runtime} if own else {})}
    cache_key = digest([ARTIFACT_FORMAT, export_read(source), settings, calibrated and calibrated.folder.name,
                        passes_fingerprint(lists),
                        [builder_fingerprint(t) for t in (tgt, fallback_target) if t]])
    dest = build_dir / f"{target}-{precision}{'-memory' if memory else ''}{options.variant()}"
    fp32 = None if memory or (target, precision) == ("ort", "fp32") or source.get("dtype", "float32") != "float32" \
        else calibrated.artifact if calibrated else plan(build_dir, "ort", "fp32")
    return BuildPlan(build_dir, tgt, precision, options, source, lists, base, own, memory_passes, memory_budget,
                     fallback_target, calibrated, settings, cache_key, dest, not force and is_current(dest, cache_key),
                     force, fp32 if fp32 and base and fp32.base == base else None, remove_export)


def calibration_size(calibration: CalibrationSettings, source: dict) -> int:
    """The image side the calibration records at (`CalibrationSettings.side`). One the export's graphs cannot take
    is refused here, before the fp32 artifact is built for it."""
    low, _, high = source["dims"]["image_height"]
    side = calibration.side(source["pipeline"]["default_image_size"], low)
    if not low <= side <= high:
        raise TargetError(f"--calibration-size {side}: this export takes images of {low} to {high} px a side; "
                          f"name a size in that range, or leave it out for the model's default")
    return side


def describe(p: BuildPlan) -> str:
    """The plan as `--dry-run` prints it."""
    state = "up to date: reused as it is" if p.up_to_date else "to build"
    lines = [f"target {p.target.name}, precision {p.precision} -> {p.dest} ({state})",
             f"  settings: {p.settings}"]
    lines += [f"  {name}: {', '.join(names) or 'no passes'}" for name, names in p.passes.items()]
    if p.prepared:
        lines.append(f"  {', '.join(p.base)}: their graphs taken from {p.prepared.dest} if it is up to date at build "
                     f"({'it is' if p.prepared.up_to_date else 'not yet'}), else run")
    if p.calibration:
        fp32 = p.calibration.artifact
        lines.append(f"  calibration: {p.calibration.settings.prompts} prompts x {p.calibration.settings.steps} steps "
                     f"on {fp32.dest} ({'up to date' if fp32.up_to_date else 'to build first'}), "
                     f"recorded in {p.calibration.folder}")
    else:
        lines.append("  calibration: none")
    return "\n".join(lines)
