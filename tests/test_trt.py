"""TensorRT targets: real TensorRT-RTX engines built on this CPU for every sd3-tiny submodule,
as fp32, fp16, bf16 and fp8 graphs, with dynamic profiles and static shapes; the engine cache; the
fallback to ONNX Runtime; the device map; and the GPU-only checks, which skip without a GPU."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from conftest import manifest, rtx_options
from gpu_double import SharedBuffers
from runners.backends.trt import gpu_capability, gpu_count
from runners.pipeline import Pipeline, check_device_map, parse_device_map
from runners.static import StaticRequest

HAS_RTX = importlib.util.find_spec("tensorrt_rtx") is not None
needs_rtx = pytest.mark.skipif(not HAS_RTX, reason="tensorrt-rtx is not installed (pip install 'diffusion-aot[trt-rtx]')")
GPUS = gpu_count()
CAPABILITY = gpu_capability()
RTX_CAPABILITIES = ("SM75", "SM80", "SM86", "SM89", "SM120", "SM121")  # TensorRT-RTX 1.7's, checked below
if GPUS == 0:
    _why_not = "no NVIDIA GPU on this machine: TensorRT engines cannot be loaded"
elif CAPABILITY not in RTX_CAPABILITIES:
    _why_not = f"this GPU is {CAPABILITY}, which TensorRT-RTX does not build for (Hopper, SM90, is not supported)"
else:
    _why_not = None
needs_gpu = pytest.mark.skipif(_why_not is not None, reason=_why_not or "")
no_gpu = pytest.mark.skipif(GPUS > 0, reason="this machine has a GPU")
SUBMODULES = ["text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "transformer_first_block", "vae_decoder",
              "vae_encoder"]


@pytest.fixture(scope="module")
def rtx(tiny_build):
    from engines.api import build_artifact

    return {p: build_artifact(tiny_build, "trt-rtx", p, options=rtx_options(tiny_build))
            for p in ("fp32", "fp16", "bf16", "fp8")}


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
        assert sub["engine"]["compute_capabilities"] == [CAPABILITY or "SM89"] and not sub["engine"]["static"]
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


STATIC = StaticRequest(height=128, width=64, prompts=2, images_per_prompt=1, guidance=True)


@needs_rtx
@pytest.mark.parametrize("options, name", [
    ({}, "trt-rtx-fp32"),
    ({"static": StaticRequest()}, "trt-rtx-fp32-static-128x128"),  # sd3-tiny's default size, filled in
    ({"static": StaticRequest(64, 96, 2, 3, False), "refittable": True},
     "trt-rtx-fp32-static-64x96-2-prompts-3-per-prompt-no-guidance-refittable"),
])
def test_the_request_of_a_static_build_names_the_folder(tiny_build, options, name):
    """Static builds for other requests sit beside each other instead of replacing one another."""
    from engines.plan import plan

    assert plan(tiny_build, "trt-rtx", "fp32", options=rtx_options(**options)).dest.name == name


def _call_shapes(artifact, request: StaticRequest) -> dict[str, dict[str, list[int]]]:
    """The shapes of every engine call of `request` on an ONNX Runtime artifact, by submodule (the
    VAE encoder as image-to-image calls it: on the request's images)."""
    shapes: dict[str, set] = {}
    pipe = Pipeline.load(artifact)
    pipe.recorder = lambda sub, feeds: shapes.setdefault(sub, set()).add(
        tuple((n, tuple(a.shape)) for n, a in sorted(feeds.items())))
    images = pipe(["a cat", "a dog"][: request.prompts], height=request.height, width=request.width,
                  num_images_per_prompt=request.images_per_prompt, guidance_scale=7.0 if request.guidance else 1.0,
                  num_inference_steps=2, output_type="np")
    pipe.vae_encode(images.transpose(0, 3, 1, 2) * 2 - 1)
    assert all(len(calls) == 1 for calls in shapes.values()), shapes  # one shape per engine
    return {sub: {n: list(s) for n, s in next(iter(calls))} for sub, calls in shapes.items()}


@needs_rtx
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_static_shapes_are_the_runners_and_the_engine_cache(rtx, tiny_build, tiny_artifact, tmp_path, capsys,
                                                            precision):
    """A static build fixes the shapes the runner calls each engine with for its request: the text
    encoders at the prompt count, the denoiser at twice the images with guidance, the VAE at the images."""
    from engines.api import build_artifact

    options = rtx_options(static=STATIC, cache_dir=tmp_path / "cache")
    static = build_artifact(tiny_build, "trt-rtx", precision, options=options)
    m = manifest(static)
    assert static.name == f"trt-rtx-{precision}-static-128x64-2-prompts"  # the request names the folder
    assert m["static"] == STATIC.record()
    called = _call_shapes(tiny_artifact, STATIC)
    assert sorted(called) == [s for s in SUBMODULES if s != "transformer_first_block"]  # only a cache calls it
    first_block = m["submodules"]["transformer_first_block"]["static_shapes"]
    assert first_block["hidden_states"] == called["transformer"]["hidden_states"]  # at the denoiser's batch
    for name, sub in m["submodules"].items():
        assert sub["engine"]["static"] and (static / sub["file"]).stat().st_size > 100_000
        if name not in called:
            continue
        assert sub["static_shapes"] == called[name], name
        assert {n: [p["min"], p["opt"], p["max"]] for n, p in sub["engine"]["profile"].items()} == {
            n: [s, s, s] for n, s in called[name].items()}, name
    assert m["submodules"]["transformer"]["static_shapes"]["hidden_states"][0] == 4  # 2 images, twice
    capsys.readouterr()
    build_artifact(tiny_build, "trt-rtx", precision, force=True, options=options)
    out = capsys.readouterr().out
    assert out.count("engine cache hit") == len(SUBMODULES) and "building the TensorRT" not in out


@needs_rtx
def test_a_static_artifact_runs_its_request_and_refuses_others(tiny_build, tiny_artifact, tmp_path, monkeypatch):
    """Through the GPU stand-in (the ONNX Runtime graphs held to the TensorRT engines' profiles, with
    reused output buffers): the static request runs and equals ONNX Runtime; any other is refused in
    one line before an engine runs."""
    from engines.api import build_artifact

    static = build_artifact(tiny_build, "trt-rtx", "fp32", options=rtx_options(static=STATIC, cache_dir=tmp_path))
    request = dict(height=128, width=64, num_inference_steps=2, seed=5, output_type="np")
    ref = Pipeline.load(tiny_artifact)(["a cat", "a dog"], **request)
    double = SharedBuffers.install(monkeypatch, tiny_artifact)
    pipe = Pipeline.load(static)
    assert all(s.profile for s in double.opened)
    assert np.array_equal(pipe(["a cat", "a dog"], **request), ref)
    calls = sum(s.calls for s in double.opened)
    for change, said in [({"height": 64}, "64x64"), ({"guidance_scale": 1.0}, "without guidance"),
                         ({"num_images_per_prompt": 2}, "2 image(s) per prompt")]:
        with pytest.raises(ValueError, match=f"this artifact's engines are static: they run 128x64, 2 prompt\\(s\\), "
                                             f"1 image\\(s\\) per prompt, with guidance only, and this request is .*{re.escape(said)}"):
            pipe(["a cat", "a dog"], **{**request, **change})
    with pytest.raises(ValueError, match="engines are static: .* this request is 128x64, 1 prompt"):
        pipe("a cat", **request)
    with pytest.raises(ValueError, match=r"text_encoder_3 is a static engine: input input_ids takes shape \(2, 256\), "
                                         r"not \(2, 77\)"):
        pipe(["a cat", "a dog"], max_sequence_length=77, **request)
    with pytest.raises(ValueError, match=r"vae_decoder is a static engine: input latent takes shape \(2, 16, 16, 8\), "
                                         r"not \(1, 16, 16, 8\)"):
        pipe.vae_decode(np.zeros((1, 16, 16, 8), np.float32))
    assert sum(s.calls for s in double.opened) == calls + 2  # the two CLIPs ran before the T5 call was refused


@needs_rtx
def test_static_requests_outside_the_export_are_refused(tiny_build):
    from engines.api import build_artifact
    from engines.targets import TargetError

    for request, said in [(StaticRequest(height=100), "static height=100 is not allowed: use a multiple of 16"),
                          (StaticRequest(prompts=3, images_per_prompt=2), "runs the denoiser at batch 12; the "
                                                                           "export allows 1 to 8")]:
        with pytest.raises(TargetError, match=said):
            build_artifact(tiny_build, "trt-rtx", "fp32", options=rtx_options(static=request))
    out = subprocess.run([sys.executable, "-m", "engines", str(tiny_build), "--target", "trt-rtx", "--static-size",
                          "64x64"], capture_output=True, text=True)
    assert out.returncode == 2 and "describe the request of a --static build: add --static" in out.stderr


@needs_rtx
def test_fallback_to_ort_is_asked_for_and_recorded(tiny_build, tmp_path, monkeypatch):
    import engines.targets.trt as trt
    from engines.api import build_artifact
    from engines.targets import SubmoduleBuildFailed, TargetError
    from engines.targets.trt import TrtOptions

    real = trt._build_engine

    def reject_vae_encoder(trt_module, rtx, onnx_path, *args):
        if onnx_path.stem == "vae_encoder":
            raise SubmoduleBuildFailed("TensorRT could not build vae_encoder: (test)")
        return real(trt_module, rtx, onnx_path, *args)

    monkeypatch.setattr(trt, "_build_engine", reject_vae_encoder)
    options = rtx_options(cache_dir=tmp_path / "cache")
    with pytest.raises(SubmoduleBuildFailed, match="could not build vae_encoder"):
        build_artifact(tiny_build, "trt-rtx", "fp32", force=True, options=options)
    # A bad setting is the user's error, not a submodule for ONNX Runtime to take over.
    with pytest.raises(TargetError, match="compute capability SM1 is not one TensorRT-RTX .* builds for; it knows: "):
        build_artifact(tiny_build, "trt-rtx", "fp32", force=True, fallback="ort",
                       options=TrtOptions(compute_capabilities=("sm1",), cache_dir=tmp_path / "cache"))
    folder = build_artifact(tiny_build, "trt-rtx", "fp32", force=True, options=options, fallback="ort")
    subs = manifest(folder)["submodules"]
    assert subs["vae_encoder"]["target"] == "ort" and subs["vae_encoder"]["file"] == "vae_encoder.onnx"
    assert subs["vae_encoder"]["backend"] == "ort" and manifest(folder)["backend"] == "trt-rtx"
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


@needs_rtx
def test_fallback_only_for_a_graph_the_builder_rejects(tiny_build, tiny_artifact, tmp_path, monkeypatch):
    """A parser or builder error on a node is SubmoduleBuildFailed (which --fallback ort takes over);
    memory and anything else stop the build with their own error, even with --fallback ort."""
    import engines.targets.trt as trt
    from engines.api import build_artifact
    from engines.targets import EngineBuildError, SubmoduleBuildFailed
    from engines.targets.trt import TrtOptions

    rtx_module = trt.use_tensorrt(True)  # before polygraphy's TensorRT backend is imported
    import polygraphy.backend.trt
    shapes = {"input_ids": ([1, 77], [1, 77], [1, 77])}

    def build(onnx, capabilities):
        trt._build_engine(rtx_module, True, onnx, shapes, capabilities, TrtOptions(), tmp_path, tmp_path / "e.plan",
                          "text_encoder")

    # Real rejections on this machine: an operator the parser does not know, and an fp32 GEMM, which
    # TensorRT-RTX does not compile for Turing.
    import onnx
    from onnx import TensorProto, helper
    from polygraphy.logger import G_LOGGER

    before = G_LOGGER.module_severity.get()  # the build quiets polygraphy's logger: checked below
    unknown_op = tmp_path / "unknown_op.onnx"
    onnx.save(helper.make_model(helper.make_graph(
        [helper.make_node("NotAnOperator", ["input_ids"], ["out"], domain="com.example")], "g",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 77])],
        [helper.make_tensor_value_info("out", TensorProto.INT64, [1, 77])]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]), unknown_op)
    with pytest.raises(SubmoduleBuildFailed, match="TensorRT could not parse text_encoder: .*NotAnOperator"):
        build(unknown_op, ["SM89"])
    with pytest.raises(SubmoduleBuildFailed, match="Cannot compile operation .* for Turing"):
        build(tiny_build / "onnx" / "text_encoder.onnx", ["SM75"])  # the export's graph, fp32
    # The build quiets polygraphy's logger (TensorRT-RTX's recovered CUDA errors without a GPU) and gives
    # the caller's level back, after the two failed builds above and after one that succeeds.
    assert G_LOGGER.module_severity.get() == before
    build(tiny_build / "onnx" / "text_encoder.onnx", ["SM89"])
    assert (tmp_path / "e.plan").stat().st_size > 100_000 and G_LOGGER.module_severity.get() == before
    # What the builder's error recorder says decides.
    assert isinstance(trt._build_error("vae", [("FAILED_ALLOCATION", "Requested amount of GPU memory")]),
                      EngineBuildError)
    assert isinstance(trt._build_error("vae", [("INTERNAL_ERROR", "OutOfMemory (no further information)")]),
                      EngineBuildError)
    assert isinstance(trt._build_error("vae", []), EngineBuildError)
    assert isinstance(trt._build_error("vae", [("UNSUPPORTED_STATE", "Could not find any implementation for node "
                                                                     "/conv_in/Conv")]), SubmoduleBuildFailed)

    # An error that is not the graph's (here the machine's) is not turned into ONNX Runtime.
    class OutOfHostMemory:
        def __init__(self, *args, **kwargs):
            pass

        def __call__(self):
            raise MemoryError("the builder ran out of host memory (test)")

    monkeypatch.setattr(polygraphy.backend.trt, "EngineBytesFromNetwork", OutOfHostMemory)
    with pytest.raises(MemoryError, match="out of host memory"):
        build_artifact(tiny_build, "trt-rtx", "fp32", force=True, fallback="ort",
                       options=rtx_options(cache_dir=tmp_path / "cache"))
    assert not (tiny_build / "trt-rtx-fp32.tmp").exists()


@needs_rtx
def test_capability_default_is_the_gpu_or_a_clear_refusal(monkeypatch):
    import engines.targets.trt as trt
    from engines.targets import TargetError

    module = trt.use_tensorrt(True)
    assert tuple(sorted(n for n in dir(module.ComputeCapability) if n.startswith("SM"))) == tuple(
        sorted(RTX_CAPABILITIES))
    monkeypatch.setattr(trt, "gpu_capability", lambda: None)
    with pytest.raises(TargetError, match="this machine has none to ask: pass --compute-capability"):
        trt._capabilities(module, True, [])
    assert trt._capabilities(module, True, ["sm86", "SM120"]) == ["SM86", "SM120"]
    monkeypatch.setattr(trt, "gpu_capability", lambda: "SM86")
    assert trt._capabilities(module, True, []) == ["SM86"]
    monkeypatch.setattr(trt, "gpu_capability", lambda: "SM90")
    with pytest.raises(TargetError, match="this machine's GPU is SM90, which TensorRT-RTX .* does not build for"):
        trt._capabilities(module, True, [])


@needs_rtx
@pytest.mark.parametrize("hidden, said", [
    ("cuda.bindings.runtime", "needs cuda-python 12.6 or later \\(module cuda.bindings.runtime\\)"),
    ("tensorrt_rtx", "needs TensorRT-RTX \\(module tensorrt_rtx\\)"),
    ("polygraphy", "needs polygraphy"),
    ("libcudart", "needs the CUDA runtime library \\(libcudart\\), which was not found"),
])
def test_a_missing_runtime_piece_names_the_extra(rtx, monkeypatch, hidden, said):
    """Each piece the runner imports, hidden: one line naming the extra, before the GPU is looked for."""
    import cuda.pathfinder

    from runners.backends.trt import MissingRuntime

    if hidden == "libcudart":
        def not_found(name):
            raise cuda.pathfinder.DynamicLibNotFoundError(f"{name} (test)")
        monkeypatch.setattr(cuda.pathfinder, "load_nvidia_dynamic_lib", not_found)
    else:
        monkeypatch.setitem(sys.modules, hidden, None)
    with pytest.raises(MissingRuntime, match=f"{said}.*: pip install 'diffusion-aot\\[trt-rtx\\]'"):
        Pipeline.load(rtx["fp32"])
    out = subprocess.run([sys.executable, "-c", f"import sys; sys.modules[{hidden!r}] = None\n"
                          "from runners.__main__ import main; sys.exit(main())", str(rtx["fp32"]), "--prompt", "a"],
                         capture_output=True, text=True) if hidden != "libcudart" else None
    if out is not None:
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and "pip install 'diffusion-aot[trt-rtx]'" in out.stderr


def test_tensorrt_and_rtx_are_not_switched_in_one_process():
    code = ("from runners.backends.trt import use_tensorrt\nuse_tensorrt(True)\nimport polygraphy.backend.trt\n"
            "use_tensorrt(False)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "RuntimeError: this process already uses TensorRT-RTX through polygraphy, which binds one TensorRT per " \
           "process: build or run TensorRT engines in another process" in out.stderr


def test_cuda_errors_are_not_ignored():
    runtime = pytest.importorskip("cuda.bindings.runtime", reason="cuda-python is not installed")
    from runners.backends.trt import _check

    with pytest.raises(RuntimeError, match="cudaSetDevice\\(7\\) failed: invalid device ordinal"):
        _check(runtime, runtime.cudaError_t.cudaErrorInvalidDevice, "cudaSetDevice(7)")


@needs_rtx
def test_cpu_settings_are_refused_for_tensorrt_engines(rtx):
    with pytest.raises(ValueError, match="threads=2 sets the CPU threads of ONNX Runtime and OpenVINO sessions; every "
                                         "engine .* opens is TensorRT's"):
        Pipeline.load(rtx["fp32"], threads=2, submodules=["transformer"])  # (an earlier test's fallback may
        # have built the fixture's vae_encoder for ONNX Runtime, which takes threads)
    with pytest.raises(ValueError, match="providers choose ONNX Runtime's execution providers; this is a TensorRT"):
        Pipeline.load(rtx["fp32"], providers=["CUDAExecutionProvider"])


@needs_rtx
@needs_gpu
def test_close_returns_device_memory(rtx):
    from cuda.bindings import runtime

    def used():
        free, total = runtime.cudaMemGetInfo()[1:]
        return total - free

    start = used()
    with Pipeline.load(rtx["fp32"]) as pipe:
        pipe("a photo of a cat", num_inference_steps=2)
        assert used() > start
    assert used() <= start + 2**20  # the CUDA context's own allocations may stay


def _linked_export(tiny_build, folder):
    """A build folder of its own holding the session's export (hard links)."""
    shutil.copytree(tiny_build / "onnx", folder / "onnx", copy_function=os.link)
    return folder


# The families whose refittable builds are checked: sd3-tiny's (the default model) and flux-tiny's, each
# named by its build and adapters fixtures, with the starting latents and settings of a short call.
REFIT_FAMILIES = {
    "sd3": ("sd3_tiny_build", "sd3_adapters", (1, 16, 16, 16), {}),
    "flux": ("flux_tiny_build", "flux_adapters", (1, 16, 64), dict(height=64, width=64, max_sequence_length=16)),
}


@dataclass(frozen=True)
class Refittable:
    folder: Path  # trt-rtx-fp32-refittable
    marked: dict  # {submodule: the weights its TensorRT network marked}
    ort: Path  # the same export's ort-fp32 artifact
    adapters: dict  # {"a": ..., "b": ...}: the family's adapter files
    latents: tuple
    settings: dict

    def images(self, pipe, seed: int, steps: int = 3):
        latents = np.random.default_rng(seed).standard_normal(self.latents, dtype=np.float32)
        return pipe("a photo of a cat", latents=latents, num_inference_steps=steps, output_type="np", **self.settings)


@pytest.fixture(scope="module", params=list(REFIT_FAMILIES))
def refittable(request, tmp_path_factory) -> Refittable:
    """trt-rtx-fp32 of the family's tiny model built --refittable, and the weights its TensorRT networks
    marked. Without a GPU TensorRT-RTX cannot compile refittable engines (test_without_a_gpu_...): every
    step before the compile is the real one (each graph parsed by TensorRT-RTX, the map's weights marked
    on its network), and the compile is a stand-in that returns a placeholder engine, which the GPU double
    never reads."""
    import engines.targets.trt as trt_target
    from engines.api import build_artifact

    build_fixture, adapters_fixture, latents, settings = REFIT_FAMILIES[request.param]
    build = request.getfixturevalue(build_fixture)
    folder = _linked_export(build.folder, tmp_path_factory.mktemp(f"{request.param}-tiny-refittable"))
    marked, mark = {}, trt_target._mark_refittable

    def spy(network, names, sub_name):
        mark(network, names, sub_name)
        marked[sub_name] = [n for n in names if network.are_weights_marked_refittable(n)]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trt_target, "_mark_refittable", spy)
        if GPUS == 0:
            patch.setattr(trt_target, "_compile", lambda *args: b"placeholder: compiled only where a GPU is")
        artifact = build_artifact(folder, "trt-rtx", "fp32", options=rtx_options(refittable=True))
    return Refittable(artifact, marked, build.folder / "ort-fp32", request.getfixturevalue(adapters_fixture),
                      latents, settings)


@needs_rtx
def test_a_refittable_build_marks_every_weight_adapters_change(refittable):
    """--refittable marks every Linear and Conv weight of the provenance table refittable on TensorRT's
    network (its parser names engine weights after the graph's initializers: the table is the refit map),
    and keeps their values beside the engine, equal to the graph's (the ONNX Runtime artifact's: the same
    passes make the same initializers)."""
    from runners.adapters.lora import artifact_weights, submodule_tables

    folder, marked, ort = refittable.folder, refittable.marked, refittable.ort
    m = manifest(folder)
    assert folder.name == "trt-rtx-fp32-refittable" and m["refittable"]
    ort_tables, ort_values = submodule_tables(ort, manifest(ort)), artifact_weights(ort)
    tables, values = submodule_tables(folder, m), artifact_weights(folder)
    assert sorted(tables) == sorted(marked) == sorted(manifest(ort)["submodules"])
    for name, table in tables.items():
        mapped = {n: r for n, r in table.items() if len(r["shape"]) >= 2}
        assert mapped and sorted(marked[name]) == sorted(mapped), name  # every one, on the real network
        assert m["submodules"][name]["engine"]["refittable_weights"] == len(mapped), name
        assert all(r["location"]["file"] == f"{name}.refit.data" for r in mapped.values()), name
        for weight, record in mapped.items():
            assert weight in ort_tables[name], f"{name}: {weight} is not the ONNX Runtime graph's"
            assert np.array_equal(values(weight, record), ort_values(weight, ort_tables[name][weight])), weight


@needs_rtx
@no_gpu
def test_without_a_gpu_a_refittable_build_says_it_needs_one(tiny_build, tmp_path):
    """TensorRT-RTX 1.7 fails to compile a refittable engine without CUDA (every refit flag; the same graph
    builds plain): the build checks the weights map, then stops in one line that says so, and writes nothing."""
    _refittable_build_refused(tiny_build, tmp_path, r"builds refittable engines only where an NVIDIA GPU is present "
                                                    r".*weights map was checked here")


def _refittable_build_refused(tiny_build, tmp_path, said: str) -> None:
    """A --refittable build of the session's export stops with `said`, and leaves the export alone."""
    from engines.api import build_artifact
    from engines.targets import TargetError

    folder = _linked_export(tiny_build, tmp_path / "build")
    with pytest.raises(TargetError, match=said):
        build_artifact(folder, "trt-rtx", "fp32", options=rtx_options(refittable=True, cache_dir=tmp_path / "cache"))
    assert sorted(p.name for p in folder.iterdir()) == ["onnx"]


@needs_rtx
def test_a_weight_the_network_lacks_stops_the_refittable_build(tiny_build, tmp_path, monkeypatch):
    """A weight adapters change that TensorRT's network does not hold could never be refitted: the build
    stops and names it, and leaves no artifact."""
    import engines.targets.trt as trt_target

    listed = trt_target._refittable_weights
    monkeypatch.setattr(trt_target, "_refittable_weights",
                        lambda sub: [*listed(sub), f"{sub.name}.not_in_the_network.weight"])
    _refittable_build_refused(tiny_build, tmp_path, r"--refittable: 1 weights of text_encoder that adapters change are "
                                                    r"not weights of its TensorRT network.*text_encoder\.not_in_the_"
                                                    r"network\.weight")


@needs_rtx
def test_adapters_switch_by_refitting_the_loaded_engines(refittable, monkeypatch):
    """Through the GPU double, which refits as TensorRT's Refitter does (only marked weights, at their
    dtype and shape): adapters A, B, A and none give the ONNX Runtime artifact's images with the same
    adapters exactly, each engine refitted in place (never opened again), and A changed the image."""
    from gpu_double import RefitSession

    double = SharedBuffers.install(monkeypatch, refittable.ort)
    a, b = {refittable.adapters["a"]: 0.8}, {refittable.adapters["b"]: 1.0}
    expected = {key: refittable.images(Pipeline.load(refittable.ort, loras=loras), seed=5)
                for key, loras in (("a", a), ("b", b), ("none", {}))}
    pipe = Pipeline.load(refittable.folder, loras=a)
    opened = len(double.opened)
    assert np.array_equal(refittable.images(pipe, seed=5), expected["a"])
    for key, loras in (("b", b), ("a", a), ("none", {})):
        pipe.set_loras(loras)
        assert np.array_equal(refittable.images(pipe, seed=5), expected[key]), key
    assert len(double.opened) == opened  # refitted, not reopened
    assert any(s.weights for s in double.opened if isinstance(s, RefitSession))
    assert np.abs(expected["a"] - expected["none"]).max() > 0.05


@needs_rtx
@needs_gpu
def test_refitted_engines_give_the_onnx_runtime_images_with_the_adapter(refittable):
    """On a GPU: the refittable engines load, take adapter A by a refit and give ONNX Runtime's images
    with A; back to none, its images without."""
    a = {refittable.adapters["a"]: 0.8}
    with Pipeline.load(refittable.folder, loras=a) as pipe:
        for loras in (a, {}):
            pipe.set_loras(loras)
            expected = refittable.images(Pipeline.load(refittable.ort, loras=loras), seed=3, steps=4)
            assert np.abs(refittable.images(pipe, seed=3, steps=4) - expected).max() <= 1e-3


def test_refit_sets_every_weight_by_name_and_refits_once():
    """runners.backends.trt.refit_weights against TensorRT's Refitter contract (a stand-in here: it
    needs an engine on a GPU): names set one by one, an unknown name, a weight TensorRT still asks for
    and an engine built without --refittable each refused with the reason."""
    from runners.backends.trt import refit_weights

    class Refitter:
        known, asks, calls = {"w", "v"}, [], []

        def __init__(self, engine, logger):
            pass

        def set_named_weights(self, name, weights):
            self.calls.append((name, weights.values))
            return name in self.known

        def get_missing_weights(self):
            return self.asks

        def refit_cuda_engine(self):
            self.calls.append("refit")
            return True

    class FakeTrt:
        class Logger:
            ERROR = 2

            def __init__(self, level):
                pass

        class Weights:
            def __init__(self, values):
                self.values = values

    FakeTrt.Refitter = Refitter
    engine = type("Engine", (), {"refittable": True})()
    w = np.ones((2, 3), np.float32)
    refit_weights(FakeTrt, engine, {"w": w, "v": w.T}, "x.plan")
    assert [c if c == "refit" else c[0] for c in Refitter.calls] == ["w", "v", "refit"]
    assert Refitter.calls[1][1].flags["C_CONTIGUOUS"]  # TensorRT reads the buffer as it is laid out
    with pytest.raises(ValueError, match="u are not refittable weights"):
        refit_weights(FakeTrt, engine, {"u": w}, "x.plan")
    Refitter.asks = ["bias"]
    with pytest.raises(RuntimeError, match="asks for bias too"):
        refit_weights(FakeTrt, engine, {"w": w}, "x.plan")
    with pytest.raises(ValueError, match="built without --refittable"):
        refit_weights(FakeTrt, type("Engine", (), {"refittable": False})(), {"w": w}, "x.plan")


@needs_rtx
def test_adapters_on_a_plain_tensorrt_artifact_are_refused_with_the_reason(rtx, tmp_path):
    """An engine built without --refittable keeps no values to adapt: an adapter is refused, saying to
    build it --refittable; `python -m engines lora` writes no TensorRT artifact (the weights are inside
    the engines)."""
    from engines.lora import apply_loras
    from lora_adapters import write_raw
    from runners.adapters.lora import LoraError, adapted_submodules, submodule_tables

    data = manifest(rtx["fp32"])
    table = submodule_tables(rtx["fp32"], data)["transformer"]
    part = next(p for r in table.values() for p in r["parts"] if p["key"].endswith("attn.to_q.weight"))
    record = next(r for r in table.values() if part in r["parts"])
    view = list(record["shape"])
    if "axis" in part:
        view[part["axis"]] = part["stop"] - part["start"]
    rows, cols = view[::-1] if part.get("perm") else view  # the checkpoint's (out, in)
    module = part["key"][:-len(".weight")]
    adapter = write_raw(tmp_path / "a.safetensors", {f"transformer.{module}.lora_A.weight": np.ones((1, cols)),
                                                     f"transformer.{module}.lora_B.weight": np.ones((rows, 1))})
    with pytest.raises(LoraError, match="a TensorRT artifact takes adapters when built with --refittable"):
        adapted_submodules(rtx["fp32"], data, {adapter: 1.0})
    with pytest.raises(LoraError, match="TensorRT engines, whose weights are inside them"):
        apply_loras(rtx["fp32"], {adapter: 1.0}, tmp_path / "out")
    assert not (tmp_path / "out").exists()
