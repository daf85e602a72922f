"""TensorRT targets: real TensorRT-RTX engines built on this CPU for every sd3-tiny submodule,
as fp32, fp16, bf16 and fp8 graphs, with dynamic profiles and static shapes; the engine cache; the
fallback to ONNX Runtime; the device map; and the GPU-only checks, which skip without a GPU."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest

from conftest import manifest
from runners.backends.trt import gpu_count
from runners.pipeline import Pipeline, check_device_map, parse_device_map

needs_rtx = pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None,
                               reason="tensorrt-rtx is not installed (pip install 'diffusion-aot[trt-rtx]')")
GPUS = gpu_count()
needs_gpu = pytest.mark.skipif(GPUS == 0, reason="no NVIDIA GPU on this machine: TensorRT engines cannot be loaded")
no_gpu = pytest.mark.skipif(GPUS > 0, reason="this machine has a GPU")
SUBMODULES = ["text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae_decoder", "vae_encoder"]


@pytest.fixture(scope="module")
def rtx(tiny_build):
    from engines.api import build_artifact

    return {p: build_artifact(tiny_build, "trt-rtx", p) for p in ("fp32", "fp16", "bf16", "fp8")}


@needs_rtx
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16", "fp8"])
def test_every_submodule_builds_a_real_engine(rtx, precision):
    import tensorrt_rtx

    folder = rtx[precision]
    m = manifest(folder)
    assert (m["target"], m["precision"]) == ("trt-rtx", precision)
    assert sorted(m["submodules"]) == SUBMODULES
    for name, sub in m["submodules"].items():
        engine = folder / sub["file"]
        assert sub["file"] == f"{name}.trt{tensorrt_rtx.__version__}.plan"
        assert engine.stat().st_size > 100_000, name  # a serialized engine, not a stub
        assert sub["engine"]["compute_capabilities"] == ["SM89"] and not sub["engine"]["static"]
        for t in sub["inputs"]:  # the profile is the manifest's min/opt/max range
            profile = sub["engine"]["profile"][t["name"]]
            for i, key in enumerate(("min", "opt", "max")):
                want = [d if isinstance(d, int) else m["dims"].get(d, [None] * 3)[i] for d in t["shape"]]
                assert [w for w in want if w is not None] == [p for p, w in zip(profile[key], want) if w is not None]
    assert (folder / m["tokenizers"]["tokenizer"]["file"]).exists() and (folder / m["scheduler"]["file"]).exists()
    if precision == "fp8":
        transformer = {r["name"]: r for r in m["submodules"]["transformer"]["passes"]}
        assert transformer["quantize_fp8"]["counts"]["linear_fp8"] == 13
    if precision != "fp32":
        assert all(s["passes"][-1]["name"] in ("to_fp16", "to_bf16", "quantize_fp8") for s in m["submodules"].values())
    if precision == "bf16":  # a strongly typed bf16 graph: the weights are bf16, the norms' statistics fp32
        for name, sub in m["submodules"].items():
            counts = sub["passes"][-1]["counts"]
            assert counts["weights_bf16"] > 0 and counts["activations_bf16"] > 0, name
    assert all(r["name"] != "fuse_attention" for s in m["submodules"].values() for r in s["passes"])


@needs_rtx
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_static_shapes_and_the_engine_cache(rtx, tiny_build, tmp_path, capsys, precision):
    from engines.api import build_artifact
    from engines.targets import BuildOptions

    options = BuildOptions(static=True, cache_dir=tmp_path / "cache")
    static = build_artifact(tiny_build, "trt-rtx", precision, options=options)
    for sub in manifest(static)["submodules"].values():
        assert sub["engine"]["static"] and (static / sub["file"]).stat().st_size > 100_000
        assert all(p["min"] == p["opt"] == p["max"] for p in sub["engine"]["profile"].values())
    capsys.readouterr()
    build_artifact(tiny_build, "trt-rtx", precision, force=True, options=options)
    out = capsys.readouterr().out
    assert out.count("engine cache hit") == len(SUBMODULES) and "building the TensorRT" not in out


@needs_rtx
def test_fallback_to_ort_is_asked_for_and_recorded(tiny_build, tmp_path, monkeypatch):
    import engines.targets.trt as trt
    from engines.api import build_artifact
    from engines.targets import BuildOptions, SubmoduleBuildFailed, TargetError

    real = trt._build_engine

    def reject_vae_encoder(trt_module, rtx, onnx_path, *args):
        if onnx_path.stem == "vae_encoder":
            raise SubmoduleBuildFailed("TensorRT could not build vae_encoder: (test)")
        return real(trt_module, rtx, onnx_path, *args)

    monkeypatch.setattr(trt, "_build_engine", reject_vae_encoder)
    options = BuildOptions(cache_dir=tmp_path / "cache")
    with pytest.raises(SubmoduleBuildFailed, match="could not build vae_encoder"):
        build_artifact(tiny_build, "trt-rtx", "fp32", force=True, options=options)
    # A bad setting is the user's error, not a submodule for ONNX Runtime to take over.
    with pytest.raises(TargetError, match="compute capability SM1 is not one TensorRT-RTX .* builds for; it knows: "):
        build_artifact(tiny_build, "trt-rtx", "fp32", force=True, fallback="ort",
                       options=BuildOptions(compute_capabilities=("sm1",), cache_dir=tmp_path / "cache"))
    folder = build_artifact(tiny_build, "trt-rtx", "fp32", force=True, options=options, fallback="ort")
    subs = manifest(folder)["submodules"]
    assert subs["vae_encoder"]["target"] == "ort" and subs["vae_encoder"]["file"] == "vae_encoder.onnx"
    assert "(test)" in subs["vae_encoder"]["fallback_because"]
    assert all("target" not in s for n, s in subs.items() if n != "vae_encoder")


@needs_rtx
@no_gpu
def test_loading_a_tensorrt_artifact_without_gpu_is_one_clear_error(rtx):
    with pytest.raises(RuntimeError, match="runs on an NVIDIA GPU, and this machine has none. Build the artifact "
                                           "with --target ort"):
        Pipeline.load(rtx["fp32"])


@no_gpu
def test_target_trt_without_gpu_says_so(tiny_build):
    out = subprocess.run([sys.executable, "-m", "engines", str(tiny_build), "--target", "trt"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "error: target 'trt' cannot build on this machine: TensorRT builds its engines on an NVIDIA GPU, and this "
        "machine has none. --target trt-rtx builds TensorRT-RTX engines without a GPU")
    assert not (tiny_build / "trt-fp32").exists()


def test_device_map_is_parsed_and_validated(tiny_artifact):
    assert parse_device_map("text_encoder_3=1, transformer=0") == {"text_encoder_3": 1, "transformer": 0}
    assert parse_device_map("") == {}
    for bad in ("text_encoder_3", "text_encoder_3=gpu1", "transformer=-1"):
        with pytest.raises(ValueError, match="is not SUBMODULE=GPU_INDEX"):
            parse_device_map(bad)
    subs = manifest(tiny_artifact)["submodules"]
    with pytest.raises(ValueError, match="names unet, which this artifact does not have; it has: text_encoder"):
        check_device_map({"unet": 0}, subs)
    with pytest.raises(ValueError, match="GPU indices are integers from 0"):
        check_device_map({"transformer": -1}, subs)
    with pytest.raises(ValueError, match="a device map places TensorRT engines"):
        Pipeline.load(tiny_artifact, device_map={"transformer": 0})


@needs_rtx
@needs_gpu
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_tensorrt_images_match_onnx_runtime(rtx, tiny_artifact, precision):
    """On a GPU: the engines load, and the whole pipeline gives the ORT artifact's images."""
    latents = np.random.default_rng(3).standard_normal((1, 16, 16, 16), dtype=np.float32)
    ref = Pipeline.load(tiny_artifact)("a photo of a cat", latents=latents, num_inference_steps=4, output_type="np")
    got = Pipeline.load(rtx[precision])("a photo of a cat", latents=latents, num_inference_steps=4, output_type="np")
    assert np.abs(got - ref).max() <= (1e-3 if precision == "fp32" else 2e-2)


@needs_rtx
@needs_gpu
def test_device_map_places_engines(rtx):
    pipe = Pipeline.load(rtx["fp32"], device_map={"text_encoder_3": GPUS - 1})
    assert pipe.device_map == {"text_encoder_3": GPUS - 1}
    with pytest.raises(ValueError, match=f"device {GPUS} does not exist"):
        Pipeline.load(rtx["fp32"], device_map={"transformer": GPUS})


@needs_rtx
def test_engine_cache_that_is_a_file(tiny_build, tmp_path):
    """A cache path that is a file is refused in one line (the CLI exits 2), before any build."""
    cache = tmp_path / "cache"
    cache.write_text("")
    run = subprocess.run([sys.executable, "-m", "engines", str(tiny_build), "--target", "trt-rtx",
                          "--engine-cache", str(cache)], capture_output=True, text=True)
    assert run.returncode == 2, run.stderr
    assert f"error: --engine-cache {cache} is a file: give a folder (created if missing)" in run.stderr
    assert "Traceback" not in run.stderr
