"""`export_model`: every submodule of a pipeline to ONNX, into <out>/onnx/ with a manifest.

One submodule at a time, traced without its weights, which stream from the checkpoint into the
graph (`export/lazy_weights.py`); each submodule's peak RSS is measured and recorded. The folder is
written under a temporary name and renamed when every graph has passed its parity check, so it is
complete or absent.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
import warnings
from pathlib import Path

from export.onnx_export import DEFAULT_OPSET, EXPORT_DTYPES, export_submodule
from export.peak_rss import peak_mib, reset_peak
from export.shapes import dim_ranges, image_multiple, probe_dims
from export.families.controlnet import controlnet_sources, specs_and_constants as controlnet_specs
from export.families.tiny_vae import SPECS as TINY_VAE_SPECS, runtime_constants as tiny_vae_constants, tiny_vae_source
from export.source import ModelSource, resolve
from export.versions import package_versions
from runners.manifest import (ManifestError, atomic_folder, digest, exclusive, is_current, read_manifest,
                              write_manifest)

EXPORT_FORMAT = 6  # bump when the graphs this code writes change for the same inputs


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
    from transformers import AutoTokenizer

    tokenizers = {}
    for component in src.family.tokenizers:
        if not src.has(component):
            continue
        tok = AutoTokenizer.from_pretrained(src.folder / component)
        tok.save_pretrained(dest / component)  # writes tokenizer.json, which the runner reads
        tokenizers[component] = {
            "file": f"{component}/tokenizer.json",
            "max_length": tok.model_max_length,
            "pad_token_id": tok.pad_token_id,
        }
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


def export_model(model: str | ModelSource, out: Path, opset: int = DEFAULT_OPSET, force: bool = False,
                 image_size: tuple[int, int, int] | None = None, dtype: str | None = None,
                 tiny_vae: str | None = None, controlnets: list[str] | tuple[str, ...] = ()) -> Path:
    """Export `model` (registry name or folder) into `out`/onnx and return that folder.

    `image_size` (min, opt, max pixels) overrides the range the engines are built for. `dtype`
    (float32, float16; default: the registry entry's) is the weights' and the computation's: an
    fp16 export never holds fp32 weights, and builds only fp16 engines. `tiny_vae` (an AutoencoderTiny
    folder, hub id or random test name, export/families/tiny_vae.py) adds `vae_decoder_tiny` and
    `vae_encoder_tiny`. `controlnets` (ControlNetModel folders, hub ids or random test names,
    export/families/controlnet.py) add engines `controlnet`, `controlnet_1`, ... after those a ControlNet
    pipeline folder holds. A submodule exported before from the same inputs (an export that only adds
    ControlNets) is taken from the existing folder, not exported again."""
    with exclusive(Path(out) / "onnx"):  # a second export into `out` waits, then reuses this one
        return _export_model(model, out, opset, force, image_size, dtype, tiny_vae, controlnets)


def _export_model(model, out, opset, force, image_size, dtype, tiny_vae, controlnets) -> Path:
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype '{dtype}': use one of {', '.join(EXPORT_DTYPES)}")
    _quiet_libraries()
    src = model if isinstance(model, ModelSource) else resolve(model)
    dtype = dtype or src.entry.export_dtype
    constants = src.family.constants(src)
    if image_size:
        sizes = _check_sizes(image_size, image_multiple(constants))
        src = dataclasses.replace(src, entry=dataclasses.replace(src.entry, image_size=sizes))
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
    control_specs, control_constants = controlnet_specs(family.name, controls)
    constants.update(control_constants)
    specs += control_specs
    sources.update({s.name: c for s, c in zip(control_specs, controls)})
    settings = [EXPORT_FORMAT, family.name, ranges, probes, opset, dtype, package_versions()]
    keys = {s.name: digest([settings, s.name, s.component, sources[s.name].fingerprint]) for s in specs}
    cache_key = digest([settings, src.fingerprint, keys])
    dest = Path(out) / "onnx"
    if not force and is_current(dest, cache_key):
        _log(f"{dest} is up to date (same weights, settings and versions): reusing it")
        return dest
    earlier = {} if force else _reusable(dest, keys)
    _log(f"{entry.name}: {len(specs)} submodule{'s' if len(specs) != 1 else ''} in {dtype} from {src.folder}")
    dynamic = set(ranges)
    with atomic_folder(dest) as tmp:
        submodules, known = {}, {}
        for spec in specs:
            if spec.name in earlier:
                submodules[spec.name], files = earlier[spec.name]
                for name, sha in files.items():
                    os.link(dest / name, tmp / name)
                    known[name] = sha
                _log(f"{spec.name}: exported before from the same inputs: taken from {dest}")
                continue
            _log(f"{spec.name}: tracing without weights, then streaming them from "
                 f"{sources[spec.name].folder / spec.component}")
            t0 = time.perf_counter()
            measured = reset_peak()
            report = export_submodule(spec, sources[spec.name], dtype, constants, dynamic, probes,
                                      tmp / f"{spec.name}.onnx", opset)
            report["peak_rss_mib"] = round(peak_mib(), 1) if measured else None
            worst = max(p["max_abs_err"] for p in report["parity"])
            report["seconds_with_checks"] = round(time.perf_counter() - t0, 2)
            rss = f", peak RSS {report['peak_rss_mib']:.0f} MiB" if measured else ""
            _log(f"{spec.name}: {report['seconds_with_checks']:.1f} s, {report['bytes'] / 2**20:.1f} MiB{rss}, "
                 f"max |onnxruntime - torch| {worst:.2e} at {len(report['parity'])} shapes")
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
                         "t5_max_length": entry.t5_length[2] if src.has("text_encoder_3") else None,
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


def _reusable(dest: Path, keys: dict[str, str]) -> dict[str, tuple[dict, dict[str, str]]]:
    """{submodule: (its manifest entry, {file: sha256})} of the submodules of the export in `dest` whose
    key is the one they would be exported with now: the same graph, taken as it is."""
    try:
        old = read_manifest(dest)
    except ManifestError:
        return {}
    reusable = {}
    for name, entry in old.get("submodules", {}).items():
        if entry.get("key") == keys.get(name):
            stem = entry["file"].split(".")[0]
            files = {f: sha for f, sha in old["files"].items() if f.split(".")[0] == stem}
            reusable[name] = (entry, files)
    return reusable


