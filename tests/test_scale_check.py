"""make scale-check's measurement: each stage's peak RSS, read and reset from outside the child at
the line that ends the stage, is that stage's own (a later small stage does not inherit an
earlier large one); and the table lands in BENCHMARKS.md without touching the other tables."""
from __future__ import annotations

import sys

from bench.report import with_section
from bench.scale_check import run_measured

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
    stages = run_measured([sys.executable, "-c", _CHILD], "rest")
    peaks = {s.name: s.peak_mib for s in stages}
    assert list(peaks) == ["export small", "export large", "engines after", "rest"]
    assert peaks["export large"] - peaks["export small"] > 350
    assert peaks["engines after"] < peaks["export large"] - 350  # reset at the line that ended "large"


def test_the_table_replaces_its_own_section_only():
    before = "# Benchmarks\n\n## A\n\nold a\n\n## Scale check: m\n\nold\n\n## B\n\nb\n"
    after = with_section(before, "Scale check: m", "new")
    assert after == "# Benchmarks\n\n## A\n\nold a\n\n## Scale check: m\n\nnew\n\n## B\n\nb\n"
    assert with_section("# Benchmarks\n", "Scale check: m", "new").endswith("## Scale check: m\n\nnew\n")
