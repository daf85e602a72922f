"""Bad input to the runner: a clear error naming the value and what is allowed, nothing written."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from runners import Pipeline
from runners.manifest import FORMAT_VERSION, ManifestError


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
    (dict(num_inference_steps=0), "num_inference_steps=0 is not allowed: use an integer from 1 to 1000"),
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
    with pytest.raises(ManifestError, match=f"format version 99; this runner reads version {FORMAT_VERSION}"):
        Pipeline.load(artifact_copy)


def test_not_an_artifact(tmp_path):
    with pytest.raises(ManifestError, match="manifest.json is missing$"):
        Pipeline.load(tmp_path)
    with pytest.raises(ManifestError, match=r"manifest.json is missing \(the folder does not exist\)$"):
        Pipeline.load(tmp_path / "nope")


def test_a_build_folder_names_the_artifacts_in_it(tiny_artifact):
    """A build folder given for an artifact: the error names the folders to pass instead."""
    with pytest.raises(ManifestError, match=rf"^{tiny_artifact.parent} is not an artifact folder: manifest.json is "
                                            r"missing; the artifacts in it: (.+, )?ort-fp32(, .+)?$"):
        Pipeline.load(tiny_artifact.parent)


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


@pytest.mark.parametrize("kwargs, message", [
    (dict(height=0), "height=0 is not allowed: use a multiple of 16 from 64 to 512"),
    (dict(width=-16), "width=-16 is not allowed"),
    (dict(height=64.0), "height=64.0 is not allowed"),
    (dict(num_images_per_prompt=0), "num_images_per_prompt=0 is not allowed: use an integer >= 1"),
    (dict(seed=-1), r"seed=-1 is not allowed: use an integer from 0 to 2\*\*63 - 1"),
    (dict(guidance_scale=float("nan")), "guidance_scale=nan is not allowed: use a finite number"),
    (dict(guidance_scale=float("inf")), "guidance_scale=inf is not allowed"),
    (dict(num_inference_steps=1001), "num_inference_steps=1001 is not allowed: use an integer from 1 to 1000"),
    (dict(num_inference_steps=2.5), "num_inference_steps=2.5 is not allowed"),
    (dict(negative_prompt=["a", "b"]), "negative_prompt has 2 entries for 1 prompts"),
    (dict(negative_prompt=3), "negative_prompt=3 is not allowed: use a string or a non-empty list of strings"),
])
def test_bad_numbers_are_refused_before_any_engine_runs(pipe, kwargs, message):
    with pytest.raises(ValueError, match=message):
        pipe("a cat", **kwargs)


@pytest.mark.parametrize("prompt", [None, [], ["a", 3], 7])
def test_bad_prompt_is_refused(pipe, prompt):
    with pytest.raises(ValueError, match="prompt=.* is not allowed: pass a string or a non-empty list of strings"):
        pipe(prompt)


def test_pndm_refuses_more_steps_than_training_timesteps():
    """Past num_train_timesteps PNDM's stride is 0: a silently wrong schedule, refused as diffusers does."""
    from runners.schedulers import load_scheduler

    pndm = load_scheduler({"_class_name": "PNDMScheduler", "num_train_timesteps": 1000, "skip_prk_steps": True,
                           "steps_offset": 1})
    pndm.start(1000)
    with pytest.raises(ValueError, match="num_inference_steps=1001 is not allowed: use an integer from 1 to 1000"):
        pndm.start(1001)


def test_export_folder_is_not_an_artifact(tiny_artifact):
    with pytest.raises(ManifestError, match=r"onnx is not an artifact but a 'onnx' folder: build an artifact from "
                                            r"the export with `python -m engines .*` and load .*/ort-fp32"):
        Pipeline.load(tiny_artifact.parent / "onnx")


@pytest.mark.parametrize("args, message", [
    (["--height", "0"], "error: height=0 is not allowed"),
    (["--num-images", "0"], "error: num_images_per_prompt=0 is not allowed"),
    (["--seed", "-1"], "error: seed=-1 is not allowed"),
    (["--guidance", "nan"], "error: guidance_scale=nan is not allowed"),
    (["--guidance", "inf"], "error: guidance_scale=inf is not allowed"),
    (["--steps", "5000"], "error: num_inference_steps=5000 is not allowed"),
])
def test_cli_bad_numbers_exit_2_and_write_nothing(tiny_artifact, tmp_path, args, message):
    out = tmp_path / "x.png"
    run = subprocess.run([sys.executable, "-m", "runners", str(tiny_artifact), "--prompt", "a cat", "--steps", "1",
                          "--out", str(out), *args], capture_output=True, text=True)
    assert run.returncode == 2 and message in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and not out.exists()


def test_cli_on_the_export_folder(tiny_artifact, tmp_path):
    run = subprocess.run([sys.executable, "-m", "runners", str(tiny_artifact.parent / "onnx"), "--prompt", "a cat",
                          "--out", str(tmp_path / "x.png")], capture_output=True, text=True)
    assert run.returncode == 2 and "is not an artifact but a 'onnx' folder" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


def test_cli_image_to_image(tiny_artifact, tmp_path):
    from PIL import Image

    source, out = tmp_path / "in.png", tmp_path / "out.png"
    Image.new("RGBA", (96, 64), (200, 120, 40, 128)).save(source)  # alpha: converted to RGB
    run = subprocess.run([sys.executable, "-m", "runners", str(tiny_artifact), "--prompt", "a cat", "--steps", "2",
                          "--image", str(source), "--strength", "0.5", "--out", str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert Image.open(out).size == (128, 128)  # SD3 resizes to the model's default size, as diffusers


def test_cli_inpainting(tiny_artifact, tmp_path):
    from PIL import Image

    source, mask, out = tmp_path / "in.png", tmp_path / "mask.png", tmp_path / "out.png"
    Image.new("RGB", (96, 64), (200, 120, 40)).save(source)
    Image.new("L", (96, 64), 255).save(mask)
    run = subprocess.run([sys.executable, "-m", "runners", str(tiny_artifact), "--prompt", "a cat", "--steps", "2",
                          "--image", str(source), "--mask", str(mask), "--num-images", "2", "--out", str(out)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["in.png", "mask.png", "out_0.png", "out_1.png"]  # and no partial files left
    assert Image.open(tmp_path / "out_1.png").size == (128, 128)  # inpainting takes the model's default size


@pytest.mark.parametrize("args, message", [
    (["--image", "missing.png"], "error: --image {dir}/missing.png does not exist"),
    (["--image", "not_an_image.png"], "error: --image {dir}/not_an_image.png is not an image file Pillow can read"),
    (["--image", "in.png", "--strength", "1.5"], "error: strength=1.5 is not allowed: use a number in (0, 1]"),
    (["--image", "in.png", "--mask", "missing.png"], "error: --mask {dir}/missing.png does not exist"),
    (["--mask", "in.png"], "error: --mask needs --image"),
    (["--image", "in.png", "--mask", "small.png"],
     "error: mask_image is 32x48 but image is 64x64 (height x width): pass a mask of the image's size"),
    (["--image", "in.png", "--out", "{dir}/x.pgn"], "error: --out {dir}/x.pgn: Pillow writes no image format with "
                                                    "the extension '.pgn'"),
])
def test_cli_bad_image_requests_exit_2_and_write_nothing(tiny_artifact, tmp_path, args, message):
    from PIL import Image

    Image.new("RGB", (64, 64)).save(tmp_path / "in.png")
    Image.new("L", (48, 32)).save(tmp_path / "small.png")
    (tmp_path / "not_an_image.png").write_text("plain text")
    before = set(tmp_path.iterdir())
    args = [str(tmp_path / a) if a.endswith(".png") else a.format(dir=tmp_path) for a in args]
    run = subprocess.run([sys.executable, "-m", "runners", str(tiny_artifact), "--prompt", "a cat", "--steps", "1",
                          "--out", str(tmp_path / "x.png"), *args], capture_output=True, text=True)
    assert run.returncode == 2 and message.format(dir=tmp_path) in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and set(tmp_path.iterdir()) == before


def test_cpu_threads_from_the_environment(tiny_artifact, monkeypatch):
    """$DIFFUSION_AOT_THREADS sets each CPU session's threads where `threads=` does not; `threads=` wins;
    a value that is not a count is refused, naming it."""
    from runners.backends import THREADS_VARIABLE, cpu_threads

    monkeypatch.setenv(THREADS_VARIABLE, "1")
    with Pipeline.load(tiny_artifact, submodules=["vae_decoder"]) as pipe:
        assert pipe.sessions["vae_decoder"].session.get_session_options().intra_op_num_threads == 1
    assert cpu_threads(2) == 2
    monkeypatch.delenv(THREADS_VARIABLE)
    assert cpu_threads(None) is None
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(THREADS_VARIABLE, bad)
        with pytest.raises(ValueError, match=f"DIFFUSION_AOT_THREADS='{bad}': give a number of threads, 1 or more"):
            cpu_threads(None)
