"""Families as packages: every export family has a runner family of the same name and the reverse,
each runner family is a package of runners/families/ that registers itself, and a family's tables
live in its package (no shared module names a family)."""
from __future__ import annotations

import re
from pathlib import Path

from export.families import FAMILIES as EXPORT_FAMILIES
from runners.pipeline import FAMILIES as RUNNER_FAMILIES

ROOT = Path(__file__).resolve().parent.parent


def test_export_and_runner_families_are_the_same_names():
    assert set(EXPORT_FAMILIES) == set(RUNNER_FAMILIES), (
        f"export only: {sorted(set(EXPORT_FAMILIES) - set(RUNNER_FAMILIES))}; "
        f"runner only: {sorted(set(RUNNER_FAMILIES) - set(EXPORT_FAMILIES))}")


def test_each_runner_family_is_its_own_package():
    for name, cls in RUNNER_FAMILIES.items():
        assert cls.__module__.startswith(f"runners.families.{name}"), (name, cls.__module__)
        assert (ROOT / "runners" / "families" / name / "__init__.py").is_file()


def test_no_shared_runner_module_names_a_family():
    """The shared core (everything of runners/ outside families/) holds no family's name as a string:
    a family's tables (preview factors, LoRA key spellings, defaults) are in its package."""
    quoted = re.compile(r"""["'](%s)["']""" % "|".join(map(re.escape, RUNNER_FAMILIES)))
    found = [f"{p.relative_to(ROOT)}:{i}" for p in (ROOT / "runners").rglob("*.py")
             if "families" not in p.parts for i, line in enumerate(p.read_text().splitlines(), 1)
             if quoted.search(line)]
    assert not found, found
