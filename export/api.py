"""`export_model`: every submodule of a pipeline to ONNX, into <out>/onnx/ with a manifest.

One submodule at a time, traced without its weights, which stream from the checkpoint into the
graph (`export/lazy_weights.py`); each submodule's peak RSS is measured and recorded. The folder is
written under a temporary name and renamed when every graph has passed its parity check, so it is
complete or absent.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import shutil
import time
import warnings
from pathlib import Path

from export.onnx_export import DEFAULT_OPSET, EXPORT_DTYPES, SharedTraces, export_submodule
from export.peak_rss import peak_mib, reset_peak
from export.prompt_formats import load_tokenizer, rendered
from export.shapes import check_example_size, dim_ranges, image_multiple, probe_dims
from export.random_weights import RECIPE
from export.families.controlnet import controlnet_sources, with_controlnets
from export.families.tiny_vae import SPECS as TINY_VAE_SPECS, runtime_constants as tiny_vae_constants, tiny_vae_source
from export.source import ModelSource, cache_root, resolve
from export.spec import SubmoduleSpec
from export.trace_cache import TraceCache
from export.versions import package_versions
from runners.manifest import (ManifestError, atomic_folder, digest, exclusive, is_current, link_or_copy,
                              read_manifest, write_manifest)

EXPORT_FORMAT = 9  # bump when the graphs this code writes change for the same inputs


def _quiet_libraries() -> None:
    """Our progress lines are the output: silence the libraries' own bars and notices."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)


def _log(msg: str) -> None:
    print(f"[export] {msg}", flush=True)


def _copy_tokenizers_and_scheduler(src: ModelSource, dest: Path) -> tuple[dict, dict]:
    tokenizers = {}
    for component in src.family.tokenizers:
        if not src.has(component):
            continue
        tok = load_tokenizer(src.folder / component)
        tok.save_pretrained(dest / component)  # writes tokenizer.json, which the runner reads
        tokenizers[component] = {
            "file": f"{component}/tokenizer.json",
            "max_length": tok.model_max_length,
            "pad_token_id": tok.pad_token_id,
            "padding_side": tok.padding_side,  # Mistral's pads on the left
        }
        fmt = src.family.prompt_formats.get(component)
        if fmt is not None:
            tokenizers[component].update(rendered(tok, fmt(src) if callable(fmt) else fmt, component))
    scheduler_dir = dest / src.family.scheduler
    scheduler_dir.mkdir()
    shutil.copy(src.folder / src.family.scheduler / "scheduler_config.json", scheduler_dir)
    config = src.config(src.family.scheduler)
    scheduler = {"file": f"{src.family.scheduler}/scheduler_config.json", "class": config["_class_name"]}
    return tokenizers, scheduler


def _check_sizes(sizes, multiple: int) -> tuple[int, int, int]:
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) != 3 or not 0 < sizes[0] <= sizes[1] <= sizes[2] or any(s % multiple for s in sizes):
        raise ValueError(f"image size range {sizes}: give MIN,OPT,MAX with MIN <= OPT <= MAX, "
                         f"multiples of {multiple} for this model")
    return sizes


def _check_frames(frames, constants: dict, name: str) -> tuple[int, int, int]:
    temporal = constants.get("vae_temporal_scale")
    if not temporal:
        raise ValueError(f"--frames: {name} makes images, not videos; leave it out")
    try:
        frames = tuple(int(f) for f in frames)
    except ValueError:
        frames = ()
    if len(frames) != 3 or not 0 < frames[0] <= frames[1] <= frames[2] or any(f % temporal != 1 for f in frames):
        raise ValueError(f"frame range {frames}: give MIN,OPT,MAX with MIN <= OPT <= MAX, each {temporal}k + 1 "
                         f"(1, {1 + temporal}, {1 + 2 * temporal}, ...)")
    return frames


def export_model(model: str | ModelSource, out: Path, opset: int = DEFAULT_OPSET, force: bool = False,
                 image_size: tuple[int, int, int] | None = None, dtype: str | None = None,
                 tiny_vae: str | None = None, controlnets: list[str] | tuple[str, ...] = (),
                 reuse_from: Path | None = None, frames: tuple[int, int, int] | None = None) -> Path:
    """Export `model` (registry name or folder) into `out`/onnx and return that folder.

    `image_size` (min, opt, max pixels) overrides the range the engines are built for; `frames` (min, opt, max)
    a video model's frame range. `dtype`
    (float32, float16; default: the registry entry's) is the weights' and the computation's: an
    fp16 export never holds fp32 weights, and builds only fp16 engines. `tiny_vae` (an AutoencoderTiny
    folder, hub id or random test name, export/families/tiny_vae.py) adds `vae_decoder_tiny` and
    `vae_encoder_tiny`. `controlnets` (ControlNetModel folders, hub ids or random test names,
    export/families/controlnet.py) add engines `controlnet`, `controlnet_1`, ... after those a ControlNet
    pipeline folder holds. A submodule exported before from the same inputs is taken as it is, not
    exported again: from `out`'s export (one that only adds ControlNets), or from another model's export
    in `reuse_from` (a folder of builds: its */onnx) whose component is the same (FLUX.1 Fill's text
    encoders and VAE, after FLUX.1 dev's)."""
    with exclusive(Path(out) / "onnx"):  # a second export into `out` waits, then reuses this one
        return _export_model(model, out, opset, force, image_size, dtype, tiny_vae, controlnets, reuse_from, frames)


def _export_model(model, out, opset, force, image_size, dtype, tiny_vae, controlnets, reuse_from, frames) -> Path:
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype '{dtype}': use one of {', '.join(EXPORT_DTYPES)}")
    _quiet_libraries()
    src = model if isinstance(model, ModelSource) else resolve(model)
    dtype = dtype or src.entry.export_dtype
    constants = src.family.constants(src)
    if image_size:
        sizes = _check_sizes(image_size, image_multiple(constants))
        src = dataclasses.replace(src, entry=dataclasses.replace(src.entry, image_size=sizes))
    if frames:
        frames = _check_frames(frames, constants, src.entry.name)
        src = dataclasses.replace(src, entry=dataclasses.replace(src.entry, frames=frames))
    family, entry = src.family, src.entry
    ranges = dim_ranges(entry, family, constants)
    probes = probe_dims(entry, family, constants)
    specs = [s for s in family.submodules if s.applies(src)]
    sources = {s.name: src for s in specs}
    tiny = tiny_vae_source(tiny_vae, constants["latent_channels"]) if tiny_vae else None
    if tiny:
        specs += TINY_VAE_SPECS
        sources.update({s.name: tiny for s in TINY_VAE_SPECS})
    controls = controlnet_sources(src, list(controlnets))
    specs, control_specs, control_constants = with_controlnets(specs, src, controls)
    constants.update(control_constants)
    specs += control_specs
    sources.update({s.name: c for s, c in zip(control_specs, controls)})
    check_example_size(entry, specs, constants)  # in one line now, not deep in torch.export's trace
    graph_settings = [EXPORT_FORMAT, opset, dtype, package_versions()]
    settings = [*graph_settings, family.name]
    cache_key = digest([settings, ranges, probes, src.fingerprint,
                        {s.name: [s.component, sources[s.name].fingerprint] for s in specs}])
    dest = Path(out) / "onnx"
    if not force and is_current(dest, cache_key):
        _log(f"{dest} is up to date (same weights, settings and versions): reusing it")
        return dest
    keys = {s.name: _submodule_key(s, sources[s.name], graph_settings, ranges, probes, constants) for s in specs}
    earlier = {} if force else _exported_before(dest, keys, reuse_from)
    _log(f"{entry.name}: {len(specs)} submodule{'s' if len(specs) != 1 else ''} in {dtype} from {src.folder}")
    dynamic = set(ranges)
    # --force traces every graph again; otherwise a graph whose architecture an earlier export traced takes its trace
    traces = SharedTraces({s.name: _trace_key(s, sources[s.name], graph_settings, ranges, probes, constants)
                           for s in specs}, None if force else TraceCache(cache_root() / "traces"))
    with atomic_folder(dest) as tmp:
        submodules, known = {}, {}
        for spec in specs:
            report = _link_earlier(earlier.get(spec.name), tmp, known)
            if report is not None:
                traces.skip(spec)
                _log(f"{spec.name}: exported before from the same inputs: taken from {earlier[spec.name][0]}")
            else:
                report = _export_one(spec, sources[spec.name], dtype, constants, dynamic, probes, tmp, opset, traces)
            submodules[spec.name] = {
                "file": f"{spec.name}.onnx",
                "inputs": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in spec.inputs],
                "outputs": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in spec.outputs],
                "quantization": spec.quantization,
                "export": report,
                "key": keys[spec.name],
                **({"source": sources[spec.name].entry.name} if spec in control_specs else {}),
            }
        tokenizers, scheduler = _copy_tokenizers_and_scheduler(src, tmp)
        write_manifest(tmp, {
            "stage": "onnx",
            "cache_key": cache_key,
            "dtype": dtype,
            "model": {"name": entry.name, "family": family.name, "source": entry.hub_id or str(src.folder),
                      "fingerprint": src.fingerprint},
            "pipeline": {**family.runtime_constants(src), "default_image_size": entry.image_size[1],
                         "text_max_length": entry.text_length[2] if src.has("text_encoder_3") else None,
                         **({"tiny_vae": tiny_vae_constants(tiny, tiny_vae)} if tiny else {})},
            "dims": {k: list(v) for k, v in ranges.items()},
            "constants": constants,
            "tokenizers": tokenizers,
            "scheduler": scheduler,
            "submodules": submodules,
            "versions": package_versions(),
        }, known)
    _log(f"wrote {dest}")
    return dest


def _export_one(spec, src, dtype, constants, dynamic, probes, tmp: Path, opset, traces) -> dict:
    folder = src.folder / spec.component
    weights = "drawn from the seeds in" if (folder / RECIPE).exists() else "streamed from"
    _log(f"{spec.name}: traced without weights (or its trace taken), then its weights {weights} {folder}")
    t0 = time.perf_counter()
    measured = reset_peak()
    report = export_submodule(spec, src, dtype, constants, dynamic, probes, tmp / f"{spec.name}.onnx", opset, traces)
    maker = traces.maker(spec)
    if maker:
        report["trace_of"] = maker
    report["peak_rss_mib"] = round(peak_mib(), 1) if measured else None
    worst = max(p["max_abs_err"] for p in report["parity"])
    report["seconds_with_checks"] = round(time.perf_counter() - t0, 2)
    rss = f", peak RSS {report['peak_rss_mib']:.0f} MiB" if measured else ""
    trace = f", trace from {maker}" if maker else ""
    _log(f"{spec.name}: {report['seconds_with_checks']:.1f} s{trace}, {report['bytes'] / 2**20:.1f} MiB{rss}, "
         f"max |onnxruntime - torch| {worst:.2e} at {len(report['parity'])} shapes")
    return report


def _submodule_key(spec, src: ModelSource, settings: list, ranges: dict, probes: list[dict], constants: dict) -> str:
    """What one graph depends on: the exporter's settings, the submodule's description (the code that wraps
    its component included, not the family that names it), its component's content, and of the shapes and
    constants only those its inputs and outputs name. A text encoder's graph is then the same in every model
    whose text encoder is (FLUX.1 dev's in Fill's and Kontext's), a VAE's in every family that describes it
    alike (FLUX.1's in Z-Image), whatever image sizes the export is for."""
    cut = [_code_name(spec.cut_from[0].wrap), _code_name(spec.cut_from[1])] if spec.cut_from else None
    return digest([settings, spec.name, spec.component, _code_name(spec.wrap), cut, spec.load_kwargs, spec.quantization,
                   _shapes_named(spec, ranges, probes, constants), src.component_digest(spec.component)])


def _trace_key(spec, src: ModelSource, settings: list, ranges: dict, probes: list[dict], constants: dict) -> str:
    """What a graph's trace depends on: the exporter's settings, the code traced (a graph cut from a trace: that
    trace's) with what it keeps in fp32 in an fp16 export (`quantization`), the shapes and constants its inputs and
    outputs name, and its component's class and configuration, not its weights. Graphs of one key take one trace
    (`SharedTraces`, `export.trace_cache`): a transformer's graph and its first-block graph, Wan 2.2 A14B's two
    transformers, a fine-tune of a model exported before."""
    traced = spec.cut_from[0] if spec.cut_from else spec
    config = {k: v for k, v in src.config(spec.component).items() if k != "_name_or_path"}  # where it was read
    return digest([settings, _code_name(traced.wrap), traced.load_kwargs, traced.quantization,
                   _shapes_named(traced, ranges, probes, constants), src.model_index()[spec.component], config])


def _shapes_named(spec, ranges: dict, probes: list[dict], constants: dict) -> list:
    """The graph's inputs and outputs, and the ranges, probe shapes and constants they name."""
    tensors = (*spec.inputs, *spec.outputs)
    names = {d for t in tensors for d in (*t.shape, t.high) if isinstance(d, str)}
    return [[str(t) for t in tensors], {d: r for d, r in ranges.items() if d in names},
            [{d: p[d] for d in p if d in names} for p in probes], {c: v for c, v in constants.items() if c in names}]


def _code_name(fn) -> str:
    """The code that wraps a component, as part of a key: a function's module and name; a partial's with its
    arguments; a closure's with what it captured (deep_cache's and first_block's wrap another spec's wrap)."""
    if isinstance(fn, functools.partial):
        return f"{_code_name(fn.func)}{fn.args!r}{sorted(fn.keywords.items())!r}"
    captured = [_captured(cell.cell_contents) for cell in getattr(fn, "__closure__", None) or ()]
    return f"{fn.__module__}.{fn.__qualname__}{captured if captured else ''}"


def _captured(value) -> str:
    """A closure's captured value in `_code_name`: a spec by its wrap, code by its name, plain data by its repr
    (an object's repr may hold its address, which would change the key in every process: its type instead)."""
    if isinstance(value, SubmoduleSpec):
        value = value.wrap
    if callable(value):
        return _code_name(value)
    return repr(value) if isinstance(value, (str, int, float, bool, tuple, type(None))) else type(value).__name__


def _exported_before(dest: Path, keys: dict[str, str], reuse_from: Path | None) -> dict[str, tuple[Path, dict, dict]]:
    """{submodule: (the export folder holding it, its manifest entry, {file: sha256})} of the submodules whose
    graph an export in `dest`, or one in `reuse_from`'s builds, already holds: the same key, the same graph."""
    builds = Path(reuse_from).glob(f"*/{dest.name}") if reuse_from else ()
    others = sorted(p for p in builds if p.resolve() != dest.resolve())
    wanted = {key: name for name, key in keys.items()}
    found = {}
    for folder in [dest, *others]:
        try:
            old = read_manifest(folder, verify=False)
        except ManifestError:
            continue
        for entry in old.get("submodules", {}).values():
            name = wanted.get(entry.get("key"))
            if name and name not in found:
                stem = entry["file"].split(".")[0]
                files = {f: sha for f, sha in old["files"].items() if f.split(".")[0] == stem}
                found[name] = (folder, entry, files)
    return found


def _link_earlier(earlier, tmp: Path, known: dict[str, str]) -> dict | None:
    """The earlier export's report, its files linked into `tmp`; None when there is none, or its folder
    changed under us (another export replacing it): then the submodule is exported anew."""
    if earlier is None:
        return None
    folder, entry, files = earlier
    try:
        for name in files:
            link_or_copy(folder / name, tmp / name)
    except OSError:
        for name in files:
            (tmp / name).unlink(missing_ok=True)
        return None
    known.update(files)
    return entry["export"]
