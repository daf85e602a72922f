"""A build is a plan, then its execution: `engines.plan.plan` says what will be built and writes
nothing, `python -m engines BUILD --dry-run` prints it, and `engines.api.execute` carries it out,
calibration included (the fp32 artifact from its own plan, not from a second build_artifact)."""
from __future__ import annotations

import inspect
import re
import shutil

import pytest

from conftest import manifest
from engines.__main__ import main as engines_main
from engines.api import build_artifact, execute
from engines.calibration import CalibrationSettings
from engines.plan import plan

ORT_PASSES = ["fold_constants", "infer_shapes", "remove_dead_nodes", "fuse_qkv", "fuse_attention"]


def _files(folder) -> set:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")}


@pytest.fixture
def fresh_build(tiny_build, tmp_path):
    """The export alone: nothing built yet."""
    shutil.copytree(tiny_build / "onnx", tmp_path / "onnx")
    return tmp_path


def test_plan_says_what_will_be_built_and_writes_nothing(fresh_build):
    before = _files(fresh_build)
    p = plan(fresh_build, "ort", "fp8", calibration=CalibrationSettings(1, 1))
    assert _files(fresh_build) == before
    assert (p.dest, p.up_to_date) == (fresh_build / "ort-fp8", False)
    for denoiser in ("transformer", "transformer_first_block"):  # fp8 quantizes the denoiser's graphs only
        assert p.passes.pop(denoiser) == [*ORT_PASSES, "quantize_fp8"]
    assert p.passes == {name: [*ORT_PASSES, "to_fp16"] for name in ("text_encoder", "text_encoder_2",
                                                                    "text_encoder_3", "vae_decoder", "vae_encoder")}
    fp32 = p.calibration.artifact
    assert (fp32.target.name, fp32.precision, fp32.dest, fp32.calibration) == ("ort", "fp32", fresh_build / "ort-fp32",
                                                                              None)
    assert p.calibration.folder.parent == fresh_build / "calibration"
    assert plan(fresh_build, "ort", "fp32").calibration is None
    assert plan(fresh_build, "ort", "int8").calibration is None  # ONNX Runtime's int8 is dynamic: nothing measured


def test_dry_run_prints_the_plan_and_writes_nothing(fresh_build, capsys):
    before = _files(fresh_build)
    assert engines_main([str(fresh_build), "--precision", "fp8", "--calibration-prompts", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert _files(fresh_build) == before
    assert out[0] == f"target ort, precision fp8 -> {fresh_build / 'ort-fp8'} (to build)"
    assert f"  transformer: {', '.join(ORT_PASSES)}, quantize_fp8" in out
    assert sum(line.startswith("  text_encoder") for line in out) == 3
    steps, fp32 = CalibrationSettings.steps, fresh_build / "ort-fp32"
    assert out[-2] == (f"  {', '.join(ORT_PASSES)}: their graphs taken from {fp32} if it is up to date at build "
                       "(not yet), else run")
    assert out[-1].startswith(f"  calibration: 2 prompts x {steps} steps on {fp32} (to build first), "
                              f"recorded in {fresh_build / 'calibration'}/")


def test_print_artifact_prints_the_folder_the_options_name_and_writes_nothing(fresh_build, capsys):
    """What `make image` runs: the folder `make engines` built with the same arguments."""
    pytest.importorskip("openvino")
    before = _files(fresh_build)
    assert engines_main([str(fresh_build), "--target", "openvino", "--precision", "bf16", "--ov-shapes", "dynamic",
                         "--print-artifact"]) == 0
    assert capsys.readouterr().out == f"{fresh_build / 'openvino-bf16-dynamic'}\n"
    assert _files(fresh_build) == before


def test_dry_run_of_a_built_artifact_says_it_is_up_to_date(tiny_artifact, capsys):
    assert engines_main([str(tiny_artifact.parent), "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"target ort, precision fp32 -> {tiny_artifact} (up to date: reused as it is)"
    assert out[-1] == "  calibration: none"
    assert plan(tiny_artifact.parent).cache_key == manifest(tiny_artifact)["cache_key"]
    assert plan(tiny_artifact.parent, force=True).up_to_date is False


def test_execute_calibrates_on_the_fp32_artifact_its_plan_names(fresh_build, capsys):
    """fp8 from a bare export: the fp32 artifact is built from the plan's own plan of it, and the
    recordings land where the plan said; each recorded prompt says the time the rest will take."""
    p = plan(fresh_build, "ort", "fp8", calibration=CalibrationSettings(2, 1))
    folder = execute(p)
    m = manifest(folder)
    assert m["cache_key"] == p.cache_key and m["precision"] == "fp8"
    assert manifest(fresh_build / "ort-fp32")["cache_key"] == p.calibration.artifact.cache_key
    assert sorted(p.name for p in (fresh_build / "calibration").iterdir()) == [p.calibration.folder.name]
    assert plan(fresh_build, "ort", "fp8", calibration=CalibrationSettings(2, 1)).up_to_date
    out = capsys.readouterr().out
    assert re.search(r"\[calibration\] prompt 1/2 recorded \(about \d+ s left\)\n", out), out
    assert "[calibration] prompt 2/2 recorded\n" in out


def test_a_calibration_size_the_export_cannot_take_is_refused_before_anything_is_built(fresh_build, capsys):
    """sd3-tiny's export takes 64 to 512 px a side: 1024 would fail at the first recorded prompt, after the fp32
    artifact was built for it."""
    before = _files(fresh_build)
    assert engines_main([str(fresh_build), "--precision", "fp8", "--calibration-size", "1024"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --calibration-size 1024: this export takes images of 64 to 512 px a side; name a size in that "
        "range, or leave it out for the model's default")
    assert _files(fresh_build) == before
    named = plan(fresh_build, "ort", "fp8", calibration=CalibrationSettings(1, 1, size=64))
    assert named.calibration.settings.size == 64


def test_the_default_calibration_size_is_the_models_up_to_256():
    """A real model's default size (1024) is not: NNCF's statistics of SD3's VAE decoder at 1024 did not fit 24 GiB,
    and at 256 the int8 image was within 0.1 dB of 512's (BENCHMARKS.md, "Calibration settings")."""
    default = CalibrationSettings()
    assert [default.side(1024, 256), default.side(512, 128), default.side(128, 64), default.side(1024, 768)] == [
        256, 256, 128, 768]
    assert CalibrationSettings(size=1024).side(1024, 256) == 1024  # named: as named


def test_calibration_progress_says_the_time_left():
    from engines.calibration import time_left

    assert time_left(10.0, 1, 32) == " (about 5 min 10 s left)"
    assert time_left(400.0, 1, 32) == " (about 3 h 26 min 40 s left)"
    assert time_left(1.0, 1, 32) == " (about 31 s left)" and time_left(5.0, 32, 32) == ""


@pytest.mark.parametrize("target, precision", [("ort", "fp16"), ("openvino", "bf16")])
def test_a_build_takes_the_target_passes_graphs_from_the_fp32_artifact(tiny_build, tmp_path, target, precision):
    """Every target runs the same passes before its precision's: a build after the fp32 ONNX Runtime artifact
    takes its graphs, weight tables and pass reports rather than running them again, and writes the same files
    as a build that runs them."""
    import dataclasses

    p = plan(tiny_build, target, precision)
    assert (p.prepared.dest, p.prepared.up_to_date) == (tiny_build / "ort-fp32", True)
    assert plan(tiny_build).prepared is None and plan(tiny_build, memory=True).prepared is None
    built = {how: execute(dataclasses.replace(p, prepared=prepared, dest=tmp_path / how, up_to_date=False))
             for how, prepared in (("run", None), ("taken", p.prepared))}
    # OpenVINO numbers the nodes it names with a counter of the process: Constant_12 in one build is
    # Constant_2049 in the next
    contents = {how: {f: re.sub(rb"(?<=[A-Za-z])_[0-9]+", b"_N", (folder / f).read_bytes())
                      for f in _files(folder) if (folder / f).is_file() and f != "manifest.json"}
                for how, folder in built.items()}
    assert contents["taken"] == contents["run"]
    built = {how: manifest(folder) for how, folder in built.items()}
    for name, sub in built["taken"]["submodules"].items():
        reports, run = sub["passes"], built["run"]["submodules"][name]["passes"]
        assert [r["name"] for r in reports] == [r["name"] for r in run] == p.passes[name]
        assert [r.get("reused_from") for r in reports] == ["ort-fp32"] * 5 + [None] * (len(reports) - 5)


def test_the_entry_points_stay_short():
    from engines.__main__ import main

    for function in (build_artifact, main):
        assert len(inspect.getsource(function).splitlines()) < 60, function.__name__


def test_a_changed_export_manifest_makes_the_artifact_out_of_date(tiny_build, tmp_path):
    """The cache key holds what a build reads of the export's manifest, its files' checksums and more: a
    re-export that changes only a constant, a quantization hint or the pipeline settings rebuilds; one
    that changes only its own record (seconds, parity errors) does not."""
    import json

    for folder in ("onnx", "ort-fp32"):
        shutil.copytree(tiny_build / folder, tmp_path / folder)
    path = tmp_path / "onnx" / "manifest.json"
    original = json.loads(path.read_text())
    assert plan(tmp_path).up_to_date

    def changed(edit) -> bool:
        data = json.loads(json.dumps(original))
        edit(data)
        path.write_text(json.dumps(data))
        return not plan(tmp_path).up_to_date

    assert changed(lambda m: m["constants"].update(latent_channels=m["constants"]["latent_channels"] + 1))
    assert changed(lambda m: m["pipeline"].update(vae_scaling_factor=0.5))
    assert changed(lambda m: m["submodules"]["transformer"]["quantization"].update(keep_scopes=["proj_out"]))
    assert changed(lambda m: m["dims"]["batch"].__setitem__(2, 3))
    assert not changed(lambda m: m["submodules"]["transformer"]["export"].update(export_seconds=1e6))
    assert not changed(lambda m: m.update(cache_key="0" * 16))


def test_a_changed_builder_makes_its_artifacts_out_of_date(tiny_build, tmp_path, monkeypatch):
    """The target's builder code is in the cache key, as the passes' is: its module (ort's here) and the private
    modules that serve it (OpenVINO's quantizer: a changed int8 recipe rebuilds the int8 artifacts)."""
    from pathlib import Path

    from engines.plan import builder_fingerprint
    from engines.targets import get_target_named

    for folder in ("onnx", "ort-fp32"):
        shutil.copytree(tiny_build / folder, tmp_path / folder)
    assert plan(tmp_path).up_to_date
    openvino = builder_fingerprint(get_target_named("openvino"))
    read = Path.read_text

    def edit(file: str) -> None:
        monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: read(self, *a, **k) + "#" * (self.name == file))

    edit("ort.py")
    assert not plan(tmp_path).up_to_date
    edit("_openvino_int8.py")
    assert builder_fingerprint(get_target_named("openvino")) != openvino
