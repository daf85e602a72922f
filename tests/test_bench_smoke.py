"""`python -m bench` runs at HEAD: every table of the registry (bench/tables/), on the tiny model of
the first family it applies to, one repetition at tiny sizes, into a temporary file. (A table's code
is the same for each of its families, whose models the family tests cover: running the U-Net families'
tables again would add 9 minutes to the suite and no code.) API drift in the
harness fails here, not on the next benchmark run. (The Optimum-ONNX, optimum-intel and openvino.genai
peers need venvs of their own, `make optimum-venv` and `make optimum-intel-venv`, and are not part of
this run: the flux table's notes say so.)

The bench's build folder links the session's export, its calibration recordings and every artifact the
session built of the tiny model (conftest runs this module last, after the tests that build them), which
the bench then finds up to date: the smoke options keep the tests' calibration settings (the default), so
that its int8 artifacts are the tests' own. Nothing is built twice in a suite run. sd3-tiny's memory
artifact is the session's fixture (test_memory and test_runner_parity use it)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.tables import TABLES, for_family

FAMILIES = sorted({family for table in TABLES.values() for family in table.families})
SMOKED = {table.families[0] for table in TABLES.values()}  # the family each table is run on
COMMON = ["--reps", "1", "--size", "128", "--steps", "2", "--gemm-size", "256"]
# Session fixtures holding an artifact, or a build beside the model's, that a family's tables would make again
# (the build folders link them).
SHARED = {"sd3": ["tiny_memory_artifact", "sd3_tiny_vae_build"]}


def _tiny(family: str) -> str | None:
    """The family's tiny registry model: <family>-tiny (z_image: z-image-tiny), else its first (flux2:
    flux2-klein-tiny)."""
    from export.registry import MODELS

    name = f"{family.replace('_', '-')}-tiny"
    tiny = [n for n, e in MODELS.items() if e.family == family and n.endswith("-tiny")]
    return name if name in tiny else next(iter(tiny), None)


def _smoke_options(names: list[str]) -> list[str]:
    """The tables' tiny options, each once (the precision and openvino tables share some)."""
    options = {}
    for name in names:
        smoke = TABLES[name].smoke
        options.update(zip(smoke[::2], smoke[1::2]))
    return [part for pair in options.items() for part in pair]


def test_every_table_applies_to_a_family_with_a_tiny_model():
    assert {"sd3", "sd15", "sdxl", "flux"} <= set(FAMILIES)
    missing = [f for f in FAMILIES if _tiny(f) is None]
    assert not missing, f"no tiny model in export/registry.py for {missing}"
    assert _tiny("z_image") == "z-image-tiny" and _tiny("flux2") == "flux2-klein-tiny"


def _linked_build(root, model: str, tiny_build) -> None:
    """root/<model> holding links to the session's export and artifacts of that model (a bench run that
    builds one of them again replaces the link, never the session's folder); and beside it, linked, the
    session's other builds, whose graphs the bench's exports then take (test_controlnet's ControlNets)."""
    build = root / model
    build.mkdir(parents=True)
    for shared in tiny_build.folder.iterdir():
        if shared.is_dir() and ((shared / "manifest.json").exists() or shared.name == "calibration"):
            os.symlink(shared, build / shared.name)
    for other in tiny_build.folder.parent.iterdir():
        if (other / "onnx" / "manifest.json").exists() and not (root / other.name).exists():
            os.symlink(other, root / other.name)


@pytest.mark.parametrize("family", sorted(SMOKED))
def test_every_table_runs(family, tmp_path, request):
    model = _tiny(family)
    names = [name for name in for_family(family) if TABLES[name].families[0] == family]
    for fixture in SHARED.get(family, []):  # made before the links
        request.getfixturevalue(fixture)
    build = request.getfixturevalue(f"{model.replace('-', '_').replace('.', '_')}_build")
    _linked_build(tmp_path / "build", model, build)
    out = tmp_path / "BENCHMARKS.md"
    args = ["--model", model, *COMMON, *_smoke_options(names), "--tables", ",".join(names),
            "--out", str(out), "--build-dir", str(tmp_path / "build")]
    # The timeout is a hang guard only: on a loaded 2-core machine sd3-tiny's tables took 17 minutes.
    run = subprocess.run([sys.executable, "-m", "bench", *args], capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    text = out.read_text()
    sections = [line[3:] for line in text.splitlines() if line.startswith("## ")]
    for name in names:
        assert any(s.startswith(TABLES[name].title) for s in sections), f"table {name!r} missing from {sections}"
    assert len(sections) == len(names), sections  # one section each (e2e: both sizes in one)
    assert "| failed |" not in text
    assert text.count(f"`python -m bench --model {model} --reps 1") == len(names)  # each table under its command


def test_a_table_of_another_family_is_refused(tmp_path):
    run = subprocess.run([sys.executable, "-m", "bench", "--model", "sd15-tiny", "--tables", "lora", "--build-dir",
                          str(tmp_path / "missing"), "--out", str(tmp_path / "B.md")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode != 0 and "table lora does not apply to sd15-tiny (family sd15)" in run.stderr
    assert not (tmp_path / "B.md").exists()
