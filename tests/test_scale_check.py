"""make scale-check's measurement: each stage's peak RSS, read and reset from outside the child at
the line that ends the stage, is that stage's own (a later small stage does not inherit an
earlier large one); and the table lands in BENCHMARKS.md without touching the other tables."""
from __future__ import annotations

import os
import sys

from bench.report import with_section
from bench.scale_check import new_bytes, remove, run_measured

_CHILD = """
import time
print("[export] small: 1.0 s, ...", flush=True)
time.sleep(0.3)
block = bytearray(400 * 2**20)  # touched: 400 MiB resident, then freed before the stage ends
time.sleep(0.3)
del block
print("[export] large: 1.0 s, ...", flush=True)
open("/proc/self/clear_refs", "w").write("5")  # as the export does when its next submodule starts
time.sleep(0.3)
print("[engines] after: fp16-ort in 1.0 s, ...", flush=True)
"""


def test_each_stage_gets_its_own_peak():
    printed = []
    stages = run_measured([sys.executable, "-c", _CHILD], "rest", lines=printed)
    peaks = {s.name: s.peak_mib for s in stages}
    assert list(peaks) == ["export small", "export large", "engines after (fp16-ort)", "rest"]
    assert peaks["export large"] - peaks["export small"] > 350
    assert peaks["engines after (fp16-ort)"] < peaks["export large"] - 350  # reset at the line that ended "large"
    assert printed[-1] == "[engines] after: fp16-ort in 1.0 s, ..."


def test_a_hard_link_to_an_earlier_stages_file_costs_no_disk(tmp_path):
    export, artifact = tmp_path / "onnx", tmp_path / "ort-fp16"
    export.mkdir(), artifact.mkdir()
    (export / "weights.data").write_bytes(b"w" * 3 * 4096)
    (artifact / "weights.data").hardlink_to(export / "weights.data")  # left unchanged by the build
    (artifact / "graph.onnx").write_bytes(b"g" * 4096)
    seen = set()
    assert new_bytes(export, seen) == 3 * 4096
    assert new_bytes(artifact, seen) == 4096


def test_a_deleted_outputs_files_are_forgotten_but_those_still_linked(tmp_path):
    """A deleted artifact's own files leave the seen inodes (the next stage's files may get their numbers: the
    wan-fullsize check's OpenVINO artifact counted 0.29 of its 7 GB so); a file it shares with the export stays."""
    export, artifact = tmp_path / "onnx", tmp_path / "ort-fp16"
    export.mkdir(), artifact.mkdir()
    (export / "weights.data").write_bytes(b"w" * 4096)
    os.link(export / "weights.data", artifact / "weights.data")
    (artifact / "own.onnx").write_bytes(b"o" * 4096)
    seen = set()
    new_bytes(export, seen), new_bytes(artifact, seen)
    own, shared = ((p.stat().st_dev, p.stat().st_ino) for p in (artifact / "own.onnx", export / "weights.data"))
    remove(artifact, seen)
    assert not artifact.exists() and own not in seen and shared in seen


def test_the_table_replaces_its_own_section_only():
    before = "# Benchmarks\n\n## A\n\nold a\n\n## Scale check: m\n\nold\n\n## B\n\nb\n"
    after = with_section(before, "Scale check: m", "new")
    assert after == "# Benchmarks\n\n## A\n\nold a\n\n## Scale check: m\n\nnew\n\n## B\n\nb\n"
    assert with_section("# Benchmarks\n", "Scale check: m", "new").endswith("## Scale check: m\n\nnew\n")


def test_a_build_that_fails_ends_in_a_stage_that_says_so():
    """A build the machine cannot hold (the kernel kills it) is a row of the table, not a lost table."""
    child = "print('[engines] transformer: ort-fp16 in 1.0 s, ...', flush=True); raise SystemExit(3)"
    stages = run_measured([sys.executable, "-c", child], "ort-fp16: tokenizers, manifest", may_fail=True)
    assert [s.name for s in stages] == ["engines transformer (ort-fp16)",
                                        "ort-fp16: tokenizers, manifest: **failed** (exit 3)"]
