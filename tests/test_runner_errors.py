"""Bad input to the runner: a clear error naming the value and what is allowed, nothing written."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from runners import Pipeline
from runners.manifest import ManifestError


@pytest.fixture(scope="module")
def pipe(tiny_artifact):
    return Pipeline.load(tiny_artifact)


@pytest.mark.parametrize("kwargs, message", [
    (dict(height=100), "height=100 is not allowed: use a multiple of 16 from 64 to 512"),
    (dict(width=72), "width=72 is not allowed: use a multiple of 16 from 64 to 512"),
    (dict(height=1024), "height=1024 is not allowed"),
    (dict(width=48), "width=48 is not allowed"),
    (dict(output_type="jpeg"), "output_type='jpeg'; allowed: pil, np, latent"),
    (dict(num_images_per_prompt=5), "batch 10 .* up to 8"),
    (dict(max_sequence_length=1000), "max_sequence_length=1000 is outside this artifact's range 1..512"),
    (dict(latents=[[0.0]]), r"latents have shape \(1, 1\); this request needs \(1, 16, 16, 16\)"),
    (dict(num_inference_steps=0), "num_inference_steps must be >= 1"),
])
def test_bad_request(pipe, kwargs, message):
    with pytest.raises(ValueError, match=message):
        pipe("a cat", **kwargs)


@pytest.fixture
def artifact_copy(tiny_artifact, tmp_path):
    return shutil.copytree(tiny_artifact, tmp_path / "artifact")


def test_missing_file(artifact_copy):
    (artifact_copy / "vae_decoder.onnx").unlink()
    with pytest.raises(ManifestError, match="vae_decoder.onnx is listed in manifest.json but missing"):
        Pipeline.load(artifact_copy)


def test_checksum_mismatch(artifact_copy):
    with open(artifact_copy / "tokenizer_2" / "tokenizer.json", "a") as f:
        f.write(" ")
    with pytest.raises(ManifestError, match="tokenizer_2/tokenizer.json does not match its checksum"):
        Pipeline.load(artifact_copy)


def test_unknown_format_version(artifact_copy):
    path = artifact_copy / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "format_version": 99}))
    with pytest.raises(ManifestError, match="format version 99; this runner reads version 1"):
        Pipeline.load(artifact_copy)


def test_not_an_artifact(tmp_path):
    with pytest.raises(ManifestError, match="manifest.json is missing"):
        Pipeline.load(tmp_path)


def test_cli_bad_size_writes_nothing(tiny_artifact, tmp_path):
    out = tmp_path / "out.png"
    r = subprocess.run([sys.executable, "-m", "runners", str(tiny_artifact), "--prompt", "a cat",
                        "--height", "100", "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 2 and "error: height=100 is not allowed" in r.stderr
    assert not out.exists()


def test_cli_writes_a_png(tiny_artifact, tmp_path):
    from PIL import Image

    out = tmp_path / "cat.png"
    r = subprocess.run([sys.executable, "-m", "runners", str(tiny_artifact), "--prompt", "a cat", "--steps", "3",
                        "--height", "64", "--width", "96", "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "denoise" in r.stdout and "3/3" in r.stderr
    assert Image.open(out).size == (96, 64)
