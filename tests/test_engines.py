"""The ORT artifact: complete manifest, checksums, caching, atomic builds, clear errors."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from engines.api import build_artifact
from engines.targets import TargetError
from runners.manifest import FORMAT_VERSION, sha256_file
from conftest import manifest

SUBMODULES = {"text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "transformer_first_block",
              "vae_decoder", "vae_encoder"}


def test_manifest_describes_the_artifact(tiny_artifact):
    m = manifest(tiny_artifact)
    assert m["format_version"] == FORMAT_VERSION
    assert m["model"]["name"] == "sd3-tiny" and m["model"]["family"] == "sd3"
    assert (m["target"], m["precision"]) == ("ort", "fp32")
    assert set(m["submodules"]) == SUBMODULES
    tr = m["submodules"]["transformer"]
    assert [t["name"] for t in tr["inputs"]] == ["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"]
    assert [t["name"] for t in tr["outputs"]] == ["noise_pred", "tail_residual"]  # the First-Block Cache's residual
    assert {t["dtype"] for t in tr["inputs"]} == {"float32"}
    assert m["submodules"]["text_encoder"]["inputs"][0]["dtype"] == "int64"
    # dynamic dims with min/opt/max: 64..512 px images, opt 128, latents 8x smaller
    assert tr["dims"]["latent_height"] == [8, 16, 64]
    assert tr["dims"]["batch"] == [1, 2, 8]
    assert m["submodules"]["text_encoder_3"]["dims"]["text_length"] == [1, 256, 512]
    assert m["submodules"]["vae_decoder"]["dims"]["image_width"] == [64, 128, 512]
    p = m["pipeline"]
    assert (p["vae_scaling_factor"], p["vae_shift_factor"]) == (1.5305, 0.0609)
    assert (p["vae_scale_factor"], p["patch_size"], p["clip_length"]) == (8, 2, 77)
    assert (m["constants"]["latent_channels"], m["constants"]["in_channels"]) == (16, 16)
    assert {"torch", "diffusers", "transformers", "onnx", "onnxruntime"} <= set(m["versions"])
    assert m["scheduler"]["class"] == "FlowMatchEulerDiscreteScheduler"
    assert set(m["tokenizers"]) == {"tokenizer", "tokenizer_2", "tokenizer_3"}


def test_every_file_is_listed_with_its_sha256(tiny_artifact):
    files = manifest(tiny_artifact)["files"]
    on_disk = {p.relative_to(tiny_artifact).as_posix() for p in tiny_artifact.rglob("*") if p.is_file()}
    assert set(files) == on_disk - {"manifest.json"}
    assert {"tokenizer/tokenizer.json", "tokenizer_3/tokenizer.json", "scheduler/scheduler_config.json",
            "transformer.onnx"} <= set(files)
    for rel, digest in files.items():
        assert sha256_file(tiny_artifact / rel) == digest


def test_unchanged_inputs_reuse_the_artifact(tiny_build, capsys):
    before = (tiny_build / "ort-fp32" / "manifest.json").stat().st_mtime_ns
    build_artifact(tiny_build, "ort", "fp32")
    assert "up to date" in capsys.readouterr().out
    assert (tiny_build / "ort-fp32" / "manifest.json").stat().st_mtime_ns == before


@pytest.mark.parametrize("error", [RuntimeError("injected"), KeyboardInterrupt()])
def test_failure_midway_leaves_no_artifact(tiny_build, tmp_path, monkeypatch, error):
    import dataclasses
    import shutil

    from engines.targets import ort

    shutil.copytree(tiny_build / "onnx", tmp_path / "onnx")
    target = ort.TARGETS[0]
    real, calls = target.build_submodule, []

    def failing(*args):
        calls.append(args)
        if len(calls) == 3:
            raise error
        return real(*args)

    monkeypatch.setattr(ort, "TARGETS", [dataclasses.replace(target, build_submodule=failing)])
    with pytest.raises(type(error)):
        build_artifact(tmp_path, "ort", "fp32")
    assert len(calls) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["onnx"]


def test_unknown_target_and_precision(tiny_build):
    with pytest.raises(TargetError, match="unknown target 'tpu'; known targets: openvino, ort"):
        build_artifact(tiny_build, "tpu", "fp32")
    with pytest.raises(TargetError, match="unknown precision 'int3' for target 'ort'; it builds: fp32, fp16, int8, fp8"):
        build_artifact(tiny_build, "ort", "int3")


def test_target_whose_backend_is_not_installed(tiny_build, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else real(name, *a))
    with pytest.raises(TargetError, match=r"needs the 'onnxruntime' module, which is not installed: pip install"):
        build_artifact(tiny_build, "ort", "fp32")


def test_missing_export_says_which_command_to_run(tmp_path):
    from runners.manifest import ManifestError

    with pytest.raises(ManifestError, match="run `python -m export MODEL"):
        build_artifact(tmp_path, "ort", "fp32")


@pytest.mark.parametrize("argv, message", [
    (["-m", "export", "no-such-model", "--out", "{tmp}"], "error: unknown model 'no-such-model'"),
    (["-m", "export", "{tmp}", "--out", "{tmp}/b"], "is not a diffusers pipeline folder"),
    (["-m", "engines", "{build}", "--target", "tpu"], "error: unknown target 'tpu'"),
    (["-m", "engines", "{build}", "--precision", "int3"], "error: unknown precision 'int3'"),
])
def test_cli_errors_are_one_line_and_nonzero(tiny_build, tmp_path, argv, message):
    argv = [a.format(tmp=tmp_path, build=tiny_build) for a in argv]
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and message in r.stderr
    assert not (tmp_path / "b").exists()
