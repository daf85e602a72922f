"""The bench's tables, one module each, and the registry `python -m bench` runs them from.

A table module declares a `TABLE`: its name (what `--tables` takes), the start of its section
title in BENCHMARKS.md, what it builds besides the model's export and ort-fp32 artifact, the
model families it applies to, its own command-line arguments, and the arguments that make it
tiny for the smoke test (tests/test_bench_smoke.py runs every table on the tiny model of the first
of its families). `measure(run)` returns its tables, each a dict of title, columns, rows and notes
(bench/report.py renders them). Adding a table is one module here and one line in `_MODULES`."""
from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import Callable

# Registry order is run order: the tables that load every variant first, the slow builds later.
_MODULES = ("submodules", "e2e", "passes", "profile", "precision", "openvino", "profiling", "tiling", "copies",
            "memory", "serving", "lora", "calibration", "flux", "z_image", "flux2", "qwen_image", "qwen_image_edit",
            "flux2_references", "wan", "wan_vae", "ltx", "caches", "first_block_split", "tiny_vae",
            "controlnet_residuals", "controlnet", "export")


@dataclass(frozen=True)
class Table:
    name: str
    title: str  # the start of its section title in BENCHMARKS.md
    builds: str  # what it builds besides the export and the default artifact
    families: tuple[str, ...]  # model families (export/families) it applies to
    measure: Callable  # (bench.run.Run) -> list of table dicts
    arguments: Callable[[argparse._ArgumentGroup], None] | None = None  # adds its own options
    smoke: tuple[str, ...] = ()  # its options at the smoke test's tiny sizes, as option-value pairs


def _load() -> dict[str, Table]:
    tables = [importlib.import_module(f"{__name__}.{m}").TABLE for m in _MODULES]
    return {t.name: t for t in tables}


TABLES = _load()


def for_family(family: str) -> list[str]:
    """The names of the tables that apply to `family`, in run order."""
    return [name for name, t in TABLES.items() if family in t.families]


def listing() -> str:
    """The registry as `python -m bench --tables` prints it."""
    width = max(map(len, TABLES))
    return "\n".join(f"{t.name:<{width}}  families: {', '.join(t.families)}; builds: {t.builds}\n"
                     f"{'':<{width}}  {t.title}..." for t in TABLES.values())
