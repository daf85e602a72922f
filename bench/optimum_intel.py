"""The OpenVINO peer: optimum-intel's export of the same pipeline folder, run by its own
OVStableDiffusion3Pipeline (bench.variants.OptimumIntel) in the openvino table. optimum-intel
pins transformers < 5.6 and declares torchvision (whose registry wheel pulls a CUDA torch), so it
lives in .venv-optimum-intel (the Makefile's `optimum-intel-venv` target).

Unlike Optimum-ONNX (bench/optimum.py), it runs transformers 5, which reads the folder as we
save it: it exports the source folder itself, without a rewritten copy.
"""
from __future__ import annotations

from pathlib import Path

from bench.optimum import export_once, timed_cli


def optimum_intel_export(python: str, src: Path, build: Path, log) -> tuple[Path, float]:
    """Export `src` with optimum-cli into build/optimum-intel (once); returns the folder and export seconds."""
    def export(tmp: Path):
        cli = str(Path(python).parent / "optimum-cli")
        argv = [cli, "export", "openvino", "--model", str(src), "--task", "text-to-image", str(tmp / "openvino")]
        return tmp / "openvino", timed_cli(argv, log)

    return export_once(build, "optimum-intel", log, export)
