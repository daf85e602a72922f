"""The OpenVINO peer: optimum-intel's export of the same pipeline folder, run by its own
OVStableDiffusion3Pipeline, against which the openvino table measures our OpenVINO artifacts.
optimum-intel pins transformers < 5.6 and declares torchvision (whose registry wheel pulls a CUDA
torch), so it lives in .venv-optimum-intel (the Makefile's `optimum-intel-venv` target).

Unlike Optimum-ONNX (bench/optimum.py), it runs transformers 5, which reads the folder as we
save it: it exports the source folder itself, without a rewritten copy.
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from bench.variants import _DiffusersCall, _timed
from runners.manifest import atomic_folder


def optimum_intel_export(python: str, src: Path, build: Path, log) -> tuple[Path, float]:
    """Export `src` with optimum-cli into build/optimum-intel (once); returns the folder and export seconds."""
    dest = build / "optimum-intel"
    record = dest / "export_seconds.json"
    if record.exists():
        log(f"{dest} exists: reusing optimum-intel's export")
        return dest / "openvino", json.loads(record.read_text())["seconds"]
    cli = Path(python).parent / "optimum-cli"
    with atomic_folder(dest) as tmp:
        log("exporting with optimum-cli export openvino (its defaults)")
        t0 = time.perf_counter()
        subprocess.run([str(cli), "export", "openvino", "--model", str(src), "--task", "text-to-image",
                        str(tmp / "openvino")], check=True)
        seconds = time.perf_counter() - t0
        (tmp / "export_seconds.json").write_text(json.dumps({"seconds": seconds}))
    return dest / "openvino", seconds


class OptimumIntel(_DiffusersCall):
    """optimum-intel's OVStableDiffusion3Pipeline on its own export (in .venv-optimum-intel), with
    its defaults: CPU, dynamic shapes, every model compiled at load."""

    RENAMED_INPUTS = {"latent": "latent_sample"}

    def __init__(self, folder: str):
        import torch
        from optimum.intel import OVStableDiffusion3Pipeline

        self.torch = torch
        self.pipe = OVStableDiffusion3Pipeline.from_pretrained(folder)
        self.pipe.set_progress_bar_config(disable=True)

    def call(self, name: str, feeds: dict) -> float:
        # Each pipeline part (pipe.text_encoder, ..., pipe.vae_decoder) holds its compiled model in
        # `request`, and calls it as below from its forward: this times the runtime alone.
        request = getattr(self.pipe, name).request
        feeds = {self.RENAMED_INPUTS.get(k, k): v for k, v in feeds.items()}
        return _timed(lambda: request(feeds, share_inputs=True))
