"""`build_artifact`: from <build>/onnx to a self-contained <build>/<target>-<precision> folder.

The artifact holds each submodule's engine, the tokenizers, the scheduler config and a
manifest the runner reads. It is built under a temporary name and renamed at the end, and
reused when the input graphs, the settings and the backend version are unchanged.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from engines.targets import get_target
from runners.manifest import (
    MANIFEST, ManifestError, atomic_folder, digest, is_current, read_manifest, write_manifest,
)

ARTIFACT_FORMAT = 1  # bump when the artifact this code writes changes for the same inputs


def _log(msg: str) -> None:
    print(f"[engines] {msg}", flush=True)


def _submodule_dims(sub: dict, dims: dict) -> dict:
    used = {d for t in sub["inputs"] + sub["outputs"] for d in t["shape"] if isinstance(d, str) and d in dims}
    return {d: dims[d] for d in sorted(used)}


def build_artifact(build_dir: Path, target: str = "ort", precision: str = "fp32", force: bool = False) -> Path:
    """Build `build_dir`/onnx into `build_dir`/`target`-`precision` and return that folder."""
    build_dir = Path(build_dir)
    tgt = get_target(target, precision)  # unknown target/precision or missing backend: fail first
    onnx_dir = build_dir / "onnx"
    if not (onnx_dir / MANIFEST).exists():
        raise ManifestError(f"{onnx_dir} has no {MANIFEST}: run `python -m export MODEL --out {build_dir}` first")
    source = read_manifest(onnx_dir)
    settings = {"target": target, "precision": precision, "backend": tgt.backend_version()}
    cache_key = digest([ARTIFACT_FORMAT, source["files"], settings])
    dest = build_dir / f"{target}-{precision}"
    if not force and is_current(dest, cache_key):
        _log(f"{dest} is up to date (same graphs, settings and {tgt.backend_module} version): reusing it")
        return dest
    with atomic_folder(dest) as tmp:
        submodules = {}
        for name, sub in source["submodules"].items():
            t0 = time.perf_counter()
            files = tgt.build_submodule(onnx_dir / sub["file"], tmp, name)
            size = sum((tmp / f).stat().st_size for f in files)
            seconds = round(time.perf_counter() - t0, 2)
            _log(f"{name}: {target}-{precision} in {seconds:.1f} s, {size / 2**20:.1f} MiB")
            submodules[name] = {
                "file": files[0],
                "inputs": sub["inputs"],
                "outputs": sub["outputs"],
                "dims": _submodule_dims(sub, source["dims"]),
                "build_seconds": seconds,
            }
        for entry in list(source["tokenizers"].values()) + [source["scheduler"]]:
            (tmp / entry["file"]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(onnx_dir / entry["file"], tmp / entry["file"])
        write_manifest(tmp, {
            "stage": "artifact",
            "cache_key": cache_key,
            "model": source["model"],
            **settings,
            "passes": [],
            "pipeline": source["pipeline"],
            "dims": source["dims"],
            "tokenizers": source["tokenizers"],
            "scheduler": source["scheduler"],
            "submodules": submodules,
            "versions": {**source["versions"], tgt.backend_distributions[0]: tgt.backend_version()},
        })
    _log(f"wrote {dest}")
    return dest
