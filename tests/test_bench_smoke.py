"""`python -m bench` runs at HEAD: every table, on sd3-tiny, one repetition at tiny sizes, into a
temporary file. API drift in the harness fails here, not on the next benchmark run. (The
Optimum-ONNX variant needs its own venv, `make optimum-venv`, and is not part of this run.)"""
from __future__ import annotations

import subprocess
import sys

from bench.__main__ import TABLES

TITLES = {  # table -> the start of its section title
    "submodules": "One call per submodule", "e2e": "End to end", "passes": "Transformer step by graph pass",
    "profile": "Transformer step at 128x128, batch 2, by op type", "precision": "Precision at 128x128",
    "openvino": "CPU runtimes at 128x128",
    "profiling": "Profiling cost", "tiling": "VAE decode, whole and tiled", "copies": "Output copies", "memory": "Activation memory",
    "export": "Export and build", "serving": "Serving with Triton at 64x64", "lora": "LoRA on a built artifact",
}


def test_every_table_runs(tmp_path):
    assert set(TITLES) == set(TABLES)
    out = tmp_path / "BENCHMARKS.md"
    args = ["--model", "sd3-tiny", "--reps", "1", "--size", "128", "--steps", "2", "--large-size", "256",
            "--large-steps", "1", "--profiling-steps", "1", "--tiling-sizes", "128,1024", "--memory-size", "128",
            "--precision-steps", "1", "--calibration-size", "64", "--calibration-steps", "1",
            "--openvino-reps", "1", "--openvino-variants", "openvino-int8", "--serving-size", "64", "--serving-steps", "1", "--serving-requests", "4",
            "--serving-clients", "2", "--lora-steps", "1", "--out", str(out), "--build-dir", str(tmp_path / "build")]
    run = subprocess.run([sys.executable, "-m", "bench", *args], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    text = out.read_text()
    sections = {line[3:] for line in text.splitlines() if line.startswith("## ")}
    for table, title in TITLES.items():
        assert any(s.startswith(title) for s in sections), f"table {table!r} missing from {sorted(sections)}"
    assert "| failed |" not in text
    assert "python -m bench --model sd3-tiny --reps 1" in text  # each table under its command
