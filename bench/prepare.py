"""Our export and reference artifact for the benchmark model (cached), run in a child process by
`python -m bench` (functions sent to a child must live in an importable module)."""
from __future__ import annotations

import os
from pathlib import Path


def default_precision(onnx_manifest: dict) -> str:
    """The precision of the ort artifact the other precisions and runtimes are measured against: fp32, or
    fp16 for an export in float16 (the full-size models), which builds into fp16 only (engines/plan.py)."""
    return "fp32" if onnx_manifest.get("dtype", "float32") == "float32" else "fp16"


def export_build(model: str, build_root: Path) -> Path:
    """`model` exported into build_root/<its name> (cached), which it returns."""
    from export.api import export_model
    from export.source import resolve

    src = resolve(model)
    build = Path(build_root) / src.entry.name
    export_model(src, build)
    return build


def build_reference(build: Path) -> Path:
    """The ort artifact of `build`'s export in its reference precision (cached)."""
    from engines.api import build_artifact
    from runners.manifest import read_manifest

    return build_artifact(build, "ort", default_precision(read_manifest(build / "onnx", verify=False)))


def tiny_vae_name(run) -> str:
    """The random tiny autoencoder benchmarked beside the run's model: its family's, at test widths for a
    "-tiny" model, else at the real one's architecture (export/families/tiny_vae.py)."""
    from export.families import FAMILIES

    return f"{FAMILIES[run.src.entry.family].tiny_vae}-{'tiny' if run.src.entry.name.endswith('-tiny') else 'bench'}"


def build_with_tiny_vae(model, build: Path, tiny: str) -> Path:
    """`build`'s model exported with the tiny autoencoder `tiny` beside its VAE (export/families/tiny_vae.py)
    and built for ort-fp32, in the folder beside `build` named after both, which it returns. The export
    links `build`'s graphs: only the tiny autoencoder is traced."""
    from engines.api import build_artifact
    from export.api import export_model

    folder = build.parent / f"{build.name}-{tiny}"
    export_model(model, folder, tiny_vae=tiny, reuse_from=build.parent)
    build_artifact(folder, "ort", "fp32")
    return folder


def build_memory(build: Path) -> Path:
    """The `--memory` artifact beside the default one (cached like it)."""
    from engines.api import build_artifact

    return build_artifact(build, "ort", "fp32", memory=True)


def sibling_build(build: Path, name: str) -> Path:
    """A build folder beside `build` that shares its export, fp32 artifact and calibration. Those are made
    first: through a link to a folder not made yet, an int8 build would write its calibration's fp32 build
    into the link and fail."""
    from engines.api import build_artifact

    build_artifact(build, "ort", "fp32")  # cached; the tables' error reference anyway
    (build / "calibration").mkdir(exist_ok=True)
    sibling = build / name
    sibling.mkdir(exist_ok=True)
    for shared in ("onnx", "ort-fp32", "calibration"):
        link = sibling / shared
        if not os.path.lexists(link):
            os.symlink(Path("..") / shared, link)
    return sibling
