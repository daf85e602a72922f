"""The openvino target and its runner backend on sd3-tiny: every submodule against ONNX Runtime fp32,
the runner against diffusers, bf16 against fp32, the compiled model shipped with the artifact, a
runner without torch, and the one-line errors."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("openvino")

from conftest import assert_real_image, image_task_outputs  # noqa: E402
from engines.api import build_artifact  # noqa: E402
from engines.plan import plan  # noqa: E402
from engines.targets import TargetError, get_target  # noqa: E402
from engines.targets._openvino_int8 import CALIBRATION_CALLS, spread  # noqa: E402
from engines.targets.openvino import OpenVinoOptions  # noqa: E402
from export.families import FAMILIES  # noqa: E402
from export.onnx_export import example_inputs  # noqa: E402
from runners import Pipeline  # noqa: E402
from runners.backends.openvino import OpenVinoSession  # noqa: E402
from runners.backends.ort import OrtSession  # noqa: E402
from bench.accuracy import psnr as _psnr  # noqa: E402

# OpenVINO fp32 against ONNX Runtime fp32, every sd3-tiny submodule at both export shapes. Measured
# (OpenVINO 2026.4.1, onnxruntime 1.32): at most 2.0e-6 of the output's scale (the VAE decoder; the
# text encoders and the transformer 2e-7 to 5e-7).
SUBMODULE_RTOL = 1e-4
ONE_LEVEL = 1 / 255
# Images against the openvino-fp32 artifact's, same prompts and latents, 128x128, 6 steps, on
# sd3-tiny over these four prompts: bf16 measured 43.6 to 44.4 dB, its bound about 10 dB under;
# int8 (NNCF 3.4) measured 36.1 to 36.8 dB, its bound 5 dB under the worst (the floor is 30).
# With 7-bit weights (every CPU since: docs/precision.md), on a Zen 3: int8 36.4 to 36.7 dB (the image tasks 34.0,
# 33.8).
# bf16 with int8 weights (`--ov-weights int8`) measured 44.0 to 46.1 dB (the image tasks included);
# with int4 weights (`--ov-weights int4`) 28.7 to 36.8 dB.
MIN_PSNR = {"bf16": 34.0, "int8": 31.0, "bf16_int8_weights": 39.0, "bf16_int4_weights": 23.0}
# What NNCF 3.4 does to sd3-tiny: FakeQuantize nodes where it quantizes activations, int8 weight
# constants (weights and their zero points) where it compresses weights only.
INT8_COUNTS = {
    "text_encoder": {"int8_weights": 20}, "text_encoder_2": {"int8_weights": 20}, "text_encoder_3": {"int8_weights": 20},
    "transformer": {"fake_quantize": 22, "linear_kept_float": 7},
    "transformer_first_block": {"fake_quantize": 10, "linear_kept_float": 7},  # First-Block Cache's: block 0 of 2
    "vae_decoder": {"fake_quantize": 33, "linear_kept_float": 0},
    "vae_encoder": {"int8_weights": 40},
}
PROMPTS = ("a photo of a cat", "a castle in the rain", "an astronaut riding a horse", "a red dragon")


@pytest.fixture(scope="module")
def ov_fp32(tiny_build):
    return build_artifact(tiny_build, "openvino", "fp32")


@pytest.fixture(scope="module")
def ov_bf16(tiny_build):
    """bf16 with the models compiled for the CPU at build time (`--ov-device CPU`)."""
    return build_artifact(tiny_build, "openvino", "bf16", options=OpenVinoOptions(device="CPU"))


@pytest.fixture(scope="module")
def ov_int8(tiny_build):
    return build_artifact(tiny_build, "openvino", "int8")


@pytest.fixture(scope="module")
def ov_bf16_int8_weights(tiny_build):
    """bf16 with its linear weights in int8 (`--ov-weights int8`)."""
    return build_artifact(tiny_build, "openvino", "bf16", options=OpenVinoOptions(weights="int8"))


@pytest.fixture(scope="module")
def ov_bf16_int4_weights(tiny_build):
    """bf16 with its linear weights in int4 (`--ov-weights int4`)."""
    return build_artifact(tiny_build, "openvino", "bf16", options=OpenVinoOptions(weights="int4"))


def _manifest(folder) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def _session(folder, name: str) -> OpenVinoSession:
    sub = _manifest(folder)["submodules"][name]
    return OpenVinoSession(folder / sub["file"], session_config=sub["session_config"],
                           session_options=sub["session_options"])


def _weight_bytes(xml) -> dict[str, int]:
    """{element type: bytes} of the IR's floating-point constants."""
    import openvino as ov

    sizes = {}
    for op in ov.Core().read_model(xml).get_ops():
        if op.get_type_name() == "Constant" and op.get_element_type().is_real():
            kind = op.get_element_type().get_type_name()
            sizes[kind] = sizes.get(kind, 0) + op.get_byte_size()
    return sizes


def test_manifest_records_the_ir_and_the_precision_hint(ov_fp32, ov_bf16):
    for folder, hint in ((ov_fp32, "f32"), (ov_bf16, "bf16")):
        manifest = _manifest(folder)
        assert manifest["target"] == "openvino" and manifest["runtime"] == {"INFERENCE_PRECISION_HINT": hint}
        assert manifest["passes"] == list(get_target("openvino", "fp32").passes)
        for name, sub in manifest["submodules"].items():
            assert sub["file"] == f"{name}.xml" and (folder / f"{name}.bin").exists()
            assert sub["session_config"] == {"INFERENCE_PRECISION_HINT": hint}
            assert [r["name"] for r in sub["passes"]] == manifest["passes"]  # no precision passes
            weights = _weight_bytes(folder / sub["file"])
            if hint == "f32":  # fp32 keeps fp32 weights
                assert set(weights) == {"f32"}, (name, weights)
            else:  # stored as fp16 (OpenVINO keeps a few scalars of shape arithmetic in f32: 8 to 16 bytes)
                assert weights.get("f32", 0) <= 64 and weights["f16"] > 10_000, (name, weights)
    assert "compiled_model" not in _manifest(ov_fp32)["submodules"]["transformer"]["session_options"]
    assert _manifest(ov_bf16)["build_options"]["device"] == "CPU"


def test_every_submodule_matches_onnx_runtime(tiny_build, ov_fp32):
    manifest = _manifest(tiny_build / "onnx")
    for spec in FAMILIES["sd3"].submodules:
        sub = manifest["submodules"][spec.name]
        ours, ref = _session(ov_fp32, spec.name), OrtSession(tiny_build / "ort-fp32" / sub["file"])
        for probe in sub["export"]["parity"]:
            arrays = example_inputs(spec, probe["dims"], manifest["constants"], seed=1)
            feeds = {t.name: a for t, a in zip(spec.inputs, arrays)}
            expected, got = ref.run(feeds), ours.run(feeds)
            assert set(got) == set(expected)
            for name, r in expected.items():
                assert got[name].shape == r.shape and got[name].dtype == r.dtype
                err = float(np.abs(got[name] - r).max())
                assert err <= SUBMODULE_RTOL * max(1.0, float(np.abs(r).max())), (spec.name, probe["dims"], name, err)


def test_outputs_are_copies_the_caller_owns(tiny_build, ov_fp32):
    spec = next(s for s in FAMILIES["sd3"].submodules if s.name == "transformer")
    export = _manifest(tiny_build / "onnx")
    constants, dims = export["constants"], export["submodules"]["transformer"]["export"]["parity"][0]["dims"]
    session = _session(ov_fp32, "transformer")
    first = session.run(dict(zip([t.name for t in spec.inputs], example_inputs(spec, dims, constants, seed=1))))
    kept = {k: v.copy() for k, v in first.items()}
    session.run(dict(zip([t.name for t in spec.inputs], example_inputs(spec, dims, constants, seed=2))), release=True)
    for name in first:
        assert np.array_equal(first[name], kept[name])


def _latents(seed: int, n: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 16, height // 8, width // 8), dtype=np.float32)


@pytest.mark.parametrize("case", [dict(prompt="a photo of a cat", height=128, width=128),
                                  dict(prompt="a dragon", negative_prompt="blurry, dark", height=80, width=144)],
                         ids=["square", "non_square_with_negative"])
def test_runner_on_openvino_fp32_matches_diffusers(ov_fp32, reference_pipeline, case):
    import torch

    kwargs = dict(case, num_inference_steps=6, max_sequence_length=64)
    latents = _latents(len(case["prompt"]), 1, case["height"], case["width"])
    ours = Pipeline.load(ov_fp32)(latents=latents, output_type="np", **kwargs)
    ref = reference_pipeline(latents=torch.from_numpy(latents), output_type="np", **kwargs).images
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= ONE_LEVEL
    assert_real_image(ref)


@pytest.fixture(scope="module")
def ov_fp32_tasks(ov_fp32):
    return image_task_outputs(Pipeline.load(ov_fp32))


def test_image_tasks_on_openvino_fp32_match_onnx_runtime(ov_fp32_tasks, tiny_artifact):
    """Image to image and inpainting, against the ORT artifact's (held to diffusers within 1e-4 in
    test_image_to_image.py): within text to image's bound against diffusers."""
    refs, got = image_task_outputs(Pipeline.load(tiny_artifact)), ov_fp32_tasks
    for task, ref in refs.items():
        assert np.abs(ref - got[task]).max() <= ONE_LEVEL - 1e-4, task


@pytest.mark.parametrize("precision", ["bf16", "int8", "bf16_int8_weights", "bf16_int4_weights"])
def test_images_against_fp32(ov_fp32, ov_fp32_tasks, precision, request):
    fp32, ours = Pipeline.load(ov_fp32), Pipeline.load(request.getfixturevalue(f"ov_{precision}"))
    latents = _latents(0, 1, 128, 128)
    for prompt in PROMPTS:
        kwargs = dict(prompt=prompt, latents=latents, output_type="np", height=128, width=128,
                      num_inference_steps=6, max_sequence_length=64)
        ref, image = fp32(**kwargs), ours(**kwargs)
        assert np.isfinite(image).all()
        psnr = 10 * np.log10(1 / float(np.mean((image - ref) ** 2)))
        print(f"openvino-{precision} {prompt!r}: PSNR {psnr:.1f} dB")
        assert psnr >= MIN_PSNR[precision], (prompt, psnr)
        assert psnr < 80, (prompt, psnr)  # the precision really ran: not the fp32 numerics
        assert_real_image(ref)
    got = image_task_outputs(ours)
    # Image to image and inpainting, held to the same bound: measured bf16 43.8, 45.9 dB, int8 34.9, 34.1.
    for task, ref in ov_fp32_tasks.items():
        psnr = _psnr(ref, got[task])
        print(f"openvino-{precision} {task}: PSNR {psnr:.1f} dB")
        assert MIN_PSNR[precision] <= psnr < 80, (task, psnr)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_compressed_weights_hold_every_linear_weight(ov_bf16, kind, request):
    """`--ov-weights int8|int4`: every MatMul and Gemm weight of 1024 elements or more is an int8 or
    int4 constant of the IR (the counts the manifest records: int4's where a block of inputs divides
    the width, else int8), the transformer's fp16 weights left are a fraction of bf16's, and the
    image is not bf16's."""
    import openvino as ov

    folder = request.getfixturevalue(f"ov_bf16_{kind}_weights")
    assert folder.name == f"openvino-bf16-{kind}-weights"
    manifest = _manifest(folder)
    for name, sub in manifest["submodules"].items():
        ops = ov.Core().read_model(folder / sub["file"]).get_ops()
        types = [op.get_element_type().get_type_name() for op in ops if op.get_type_name() == "Constant"]
        engine = sub["engine"]
        assert (types.count("i8"), types.count("i4")) == (engine.get("int8_weights", 0), engine.get("int4_weights", 0))
        if name.startswith("vae"):  # sd3-tiny's VAE: convolutions, and 16x16 attention weights
            continue
        assert engine[f"{kind}_weights"] > 0 and engine["weights"] == f"i{kind[3:]} and f16", name
    for name in ("transformer", "transformer_first_block"):
        plain = _weight_bytes(ov_bf16 / f"{name}.xml")["f16"]
        assert _weight_bytes(folder / f"{name}.xml").get("f16", 0) < plain / 3, name
    kwargs = dict(prompt=PROMPTS[0], latents=_latents(0, 1, 128, 128), output_type="np", height=128, width=128,
                  num_inference_steps=6, max_sequence_length=64)
    psnr = _psnr(Pipeline.load(ov_bf16)(**kwargs), Pipeline.load(folder)(**kwargs))
    print(f"bf16 against bf16 with {kind} weights: PSNR {psnr:.1f} dB")
    assert psnr < 60


def test_int8_weights_are_within_half_a_step_per_output_channel():
    """A MatMul's (in, out) weight gets a scale per column, a Gemm's transposed (out, in) one per row."""
    import onnx_ir as ir

    from engines.targets._openvino_weights import compress_weights

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 96)) * np.linspace(0.01, 3, 96)).astype(np.float32)  # columns of many scales
    for op, weight, attrs in (("MatMul", w, []), ("Gemm", w.T.copy(), [ir.AttrInt64("transB", 1)])):
        x = ir.Value(name="x", shape=ir.Shape([2, 64]), type=ir.TensorType(ir.DataType.FLOAT))
        init = ir.Value(name="w", shape=ir.Shape(weight.shape), type=ir.TensorType(ir.DataType.FLOAT),
                        const_value=ir.tensor(weight))
        node = ir.Node("", op, [x, init], attributes=attrs)
        model = ir.Model(ir.Graph([x], node.outputs, nodes=[node], initializers=[init], opset_imports={"": 20}),
                         ir_version=10)
        assert compress_weights(model) == {"int8": 1} and "w" not in model.graph.initializers
        q, scale = (model.graph.initializers[f"w_{k}"].const_value.numpy() for k in ("int8", "scale"))
        axis = 0 if op == "Gemm" else 1
        restored = q.astype(np.float32) * np.expand_dims(scale, 1 - axis)
        assert np.all(np.abs(restored - weight) <= np.expand_dims(scale, 1 - axis) / 2 + 1e-7), op
        assert np.abs(q).max(axis=1 - axis).min() == 127  # each channel's largest weight maps to 127


def _linear(op: str, weight: np.ndarray):
    import onnx_ir as ir

    x = ir.Value(name="x", shape=ir.Shape([2, weight.shape[1 if op == "Gemm" else 0]]),
                 type=ir.TensorType(ir.DataType.FLOAT))
    init = ir.Value(name="w", shape=ir.Shape(weight.shape), type=ir.TensorType(ir.DataType.FLOAT),
                    const_value=ir.tensor(weight))
    node = ir.Node("", op, [x, init], attributes=[ir.AttrInt64("transB", 1)] if op == "Gemm" else [])
    node.outputs[0].name = "y"
    return ir.Model(ir.Graph([x], node.outputs, nodes=[node], initializers=[init], opset_imports={"": 20}),
                    ir_version=9)


def test_a_build_sends_no_usage_telemetry(monkeypatch, tmp_path):
    """OpenVINO's converter reports each call through openvino_telemetry's one instance per process, whose consent
    is on by default (no consent file); a build turns it off, in an instance made before it (NNCF makes one when
    imported) and in the next process's first. Nothing is sent by this test: the sender only records."""
    import onnx_ir as ir
    import openvino as ov
    from openvino_telemetry import Telemetry
    from openvino_telemetry.utils.opt_in_checker import ConsentCheckResult, OptInChecker
    from openvino_telemetry.utils.sender import TelemetrySender

    from engines.targets.openvino import without_usage_telemetry

    sent = []
    monkeypatch.setattr(TelemetrySender, "send", lambda self, backend, message: sent.append(message))
    ir.save(_linear("MatMul", np.ones((4, 3), np.float32)), tmp_path / "m.onnx")
    ov.convert_model(tmp_path / "m.onnx")  # makes the instance, if no test did
    monkeypatch.setattr(Telemetry(), "consent", True)  # as on a user's machine
    monkeypatch.setattr(OptInChecker, "_run_in_ci", staticmethod(lambda: False))
    ov.convert_model(tmp_path / "m.onnx")
    assert sent, "the converter reported nothing with telemetry on: this test would prove nothing"
    sent.clear()
    without_usage_telemetry()
    ov.convert_model(tmp_path / "m.onnx")
    assert not sent
    assert OptInChecker().check(enable_opt_in_dialog=False, disable_in_ci=True) == ConsentCheckResult.DECLINED


def test_int4_weights_are_within_half_a_step_per_block(tmp_path):
    """`--ov-weights int4`: a scale per output channel and 128 inputs, each block's largest weight at
    7; OpenVINO reads the blocked DequantizeLinear and computes what it says. An input width that no
    block of 16 or more divides gets int8 per channel."""
    import onnx_ir as ir
    import openvino as ov

    from engines.targets._openvino_weights import compress_weights

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((256, 96)) * np.linspace(0.01, 3, 256)[:, None]).astype(np.float32)  # blocks differ
    x = rng.standard_normal((2, 256)).astype(np.float32)
    for op, weight in (("MatMul", w), ("Gemm", w.T.copy())):
        model = _linear(op, weight)
        assert compress_weights(model, "int4") == {"int4": 1} and model.opset_imports[""] == 21
        q, scale = (model.graph.initializers[f"w_{k}"].const_value.numpy() for k in ("int4", "scale"))
        blocks = (q if op == "Gemm" else q.T).reshape(96, 2, 128).astype(np.float32)
        per_block = scale if op == "Gemm" else scale.T  # (channels, blocks)
        restored = blocks * per_block[:, :, None]
        assert np.all(np.abs(restored - w.T.reshape(96, 2, 128)) <= per_block[:, :, None] / 2 + 1e-7), op
        assert np.abs(blocks).max(axis=2).min() == 7
        ir.save(model, tmp_path / f"{op}.onnx")
        # Dynamic quantization off: by default the plugin also quantizes the activations that meet
        # compressed weights (about 4e-3 of the scale here); this checks the weights' layout exactly.
        y = ov.Core().compile_model(ov.convert_model(tmp_path / f"{op}.onnx"), "CPU",
                                    {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"})(x)[0]
        expected = x @ restored.reshape(96, 256).T
        assert np.abs(y - expected).max() <= 1e-4 * np.abs(expected).max(), op
        assert np.abs(y - x @ w).max() > 1e-3 * np.abs(expected).max()  # int4 is not the float weight
    odd = _linear("MatMul", rng.standard_normal((40, 96)).astype(np.float32))  # 40 = 8 x 5: int8 per channel
    assert compress_weights(odd, "int4") == {"int4": 0, "int8": 1} and odd.opset_imports[""] == 20


def test_nncf_calibrates_on_calls_spread_over_the_recording():
    assert spread(5) == [0, 1, 2, 3, 4]
    picked = spread(416)  # e.g. a U-Net's 32 prompts x 8 steps, and the image tasks' calls
    assert len(picked) == CALIBRATION_CALLS and picked == sorted(set(picked))
    assert picked[0] == 0 and picked[-1] > 416 - 2 * 416 / CALIBRATION_CALLS  # the last prompts too


def test_int8_records_what_nncf_quantized(tiny_build, ov_int8):
    """Weights and activations in the transformer (its embedders and final layers kept in float, as
    ONNX Runtime's int8 keeps them) and in the VAE decoder; weights only in the others."""
    import onnx

    from engines.passes.ort_tools import nodes_in_scopes

    manifest = _manifest(ov_int8)
    assert manifest["runtime"] == {"INFERENCE_PRECISION_HINT": "bf16"} and "calibration" in manifest
    counts = {name: sub["quantization"]["counts"] for name, sub in manifest["submodules"].items()}
    assert counts == INT8_COUNTS
    assert {sub["engine"]["weights"] for sub in manifest["submodules"].values()} == {"i8 and f16"}
    transformer = manifest["submodules"]["transformer"]["quantization"]
    recorded = manifest["calibration"]["calls"]["transformer"]
    assert transformer["calls_recorded"] == recorded
    assert transformer["calibration_calls"] == min(recorded, CALIBRATION_CALLS)  # all of the default's
    export = _manifest(tiny_build / "onnx")["submodules"]["transformer"]
    proto = onnx.load(tiny_build / "onnx" / export["file"], load_external_data=False)
    scoped = nodes_in_scopes(proto, export["quantization"]["keep_scopes"], ["MatMul"])
    assert scoped and set(scoped) <= set(transformer["kept_float"])


def test_compiled_model_is_imported_not_compiled(ov_bf16, monkeypatch):
    import openvino as ov

    def no_compile(*args, **kwargs):
        raise AssertionError("compile_model called for an artifact that ships its compiled models")

    monkeypatch.setattr(ov.Core, "compile_model", no_compile)
    pipe = Pipeline.load(ov_bf16)
    inputs = {"hidden_states": [2, 16, 16, 16], "encoder_hidden_states": [2, 333, 96], "pooled_projections": [2, 80],
              "timestep": [2]}
    # First-Block Cache's graph also takes the tail residual: 8x8 patches of the 16x16 latent, 32 wide. The VAE
    # runs at the image count, the denoiser at twice that (guidance).
    static_inputs = {"transformer": inputs, "transformer_first_block": {**inputs, "tail_residual": [2, 64, 32]},
                     "vae_decoder": {"latent": [1, 16, 16, 16]}, "vae_encoder": {"image": [1, 3, 128, 128]}}
    for name, sub in _manifest(ov_bf16)["submodules"].items():
        if name in static_inputs:  # per-size: compiled static at the export's opt size (the default 128x128)
            assert sub["session_options"] == {"device": "CPU", "shapes": "per-size", "static_models": [
                {"size": "128x128", "file": f"{name}.128x128.cpu.blob", "shapes": static_inputs[name]}]}
        else:
            assert sub["session_options"] == {"device": "CPU", "shapes": "dynamic", "compiled_model": f"{name}.cpu.blob"}
    # At the default size (batch 2 with guidance, 256 T5 tokens) every model comes from a blob.
    image = pipe("a cat", height=128, width=128, num_inference_steps=1, seed=0, output_type="np")
    assert image.shape == (1, 128, 128, 3) and all(s.imported for s in pipe.sessions.values())


def test_per_size_compiles_once_per_shape_and_keeps_two(ov_fp32):
    """The default of the submodules the image size shapes: reshaped to each set of input shapes at its first
    call, the compiled model kept for the next calls of that size, the two most recent sizes kept."""
    manifest = _manifest(ov_fp32)
    # Every submodule the image size shapes; the text encoders, whose shapes only the prompt count sets, stay dynamic.
    assert {name: sub["session_options"]["shapes"] for name, sub in manifest["submodules"].items()} == {
        "text_encoder": "dynamic", "text_encoder_2": "dynamic", "text_encoder_3": "dynamic",
        "transformer": "per-size", "transformer_first_block": "per-size", "vae_decoder": "per-size",
        "vae_encoder": "per-size"}
    per_size = _session(ov_fp32, "transformer")
    dynamic = OpenVinoSession(ov_fp32 / "transformer.xml", session_options={"shapes": "dynamic"},
                              session_config={"INFERENCE_PRECISION_HINT": "f32"})
    assert per_size.compiles == 0 and dynamic.compiles == 1  # per-size compiles nothing at load
    spec = next(s for s in FAMILIES["sd3"].submodules if s.name == "transformer")
    for i, (latent, joint) in enumerate(((16, 333), (16, 333), (8, 104), (12, 333), (16, 333))):
        dims = {"batch": 2, "latent_height": latent, "latent_width": latent, "joint_length": joint}
        feeds = {t.name: a for t, a in zip(spec.inputs, example_inputs(spec, dims, manifest["constants"], seed=i))}
        got, expected = per_size.run(feeds)["noise_pred"], dynamic.run(feeds)["noise_pred"]
        # Measured: static and dynamic compiles of the same fp32 IR agree within 3e-7 of the output's scale.
        np.testing.assert_allclose(got, expected, atol=SUBMODULE_RTOL * np.abs(expected).max())
        assert got.shape == (2, 16, latent, latent)
    # 16 compiled, reused, then 8 and 12 (16 dropped as the oldest), then 16 again.
    assert per_size.compiles == 4 and len(per_size.per_size) == 2


def test_remove_export_frees_each_graph_before_its_ir_is_written(tiny_build, ov_fp32, tmp_path, monkeypatch):
    """`--remove-export` (a real-size model whose export and artifact do not fit on the disk together): each
    submodule's exported graph, weights and weight table are gone before its IR is written; the tokenizers and
    scheduler the artifact copies stay; the artifact makes ov_fp32's image."""
    import shutil
    from pathlib import Path

    import openvino as ov

    from runners.manifest import read_manifest
    from runners.pipeline import Pipeline

    shutil.copytree(tiny_build / "onnx", tmp_path / "onnx")
    exported = {name: tmp_path / "onnx" / sub["file"]
                for name, sub in read_manifest(tmp_path / "onnx", verify=False)["submodules"].items()}
    left_at_save, save = [], ov.save_model

    def saving(model, path, **kwargs):
        left_at_save.append(exported[Path(path).stem].exists())
        return save(model, path, **kwargs)

    monkeypatch.setattr(ov, "save_model", saving)
    artifact = build_artifact(tmp_path, "openvino", "fp32", remove_export=True)
    assert left_at_save == [False] * len(exported)
    assert not [p.name for p in (tmp_path / "onnx").iterdir() if p.name.split(".")[0] in exported]
    assert (tmp_path / "onnx" / "manifest.json").exists() and (tmp_path / "onnx" / "scheduler").is_dir()
    call = dict(num_inference_steps=2, output_type="np", seed=0)
    assert np.array_equal(Pipeline.load(artifact)("a cat", **call), Pipeline.load(ov_fp32)("a cat", **call))


def test_unknown_shapes_are_refused(tiny_build):
    with pytest.raises(TargetError, match=r"^--ov-shapes static: the openvino target takes dynamic or per-size$"):
        build_artifact(tiny_build, "openvino", "fp32", options=OpenVinoOptions(shapes="static"))


@pytest.mark.parametrize("options, name", [
    (OpenVinoOptions(), "openvino-fp32"),
    (OpenVinoOptions(shapes="per-size"), "openvino-fp32"),  # the default, named: the same artifact
    (OpenVinoOptions(shapes="dynamic"), "openvino-fp32-dynamic"),
    (OpenVinoOptions(device="GPU.1"), "openvino-fp32-gpu-1"),
    (OpenVinoOptions(weights="int4", shapes="dynamic", device="CPU", sizes=((64, 96), (128, 128))),
     "openvino-fp32-int4-weights-dynamic-cpu-64x96-128x128"),
])
def test_every_option_that_changes_the_manifest_names_the_folder(tiny_build, options, name):
    """Builds with other options sit beside the default artifact instead of replacing it."""
    built = plan(tiny_build, "openvino", "fp32", options=options)
    assert built.dest.name == name
    assert (built.cache_key == plan(tiny_build, "openvino", "fp32").cache_key) == (name == "openvino-fp32")


def test_listed_sizes_are_compiled_static_at_build_time(tiny_build, ov_fp32, monkeypatch):
    import openvino as ov

    folder = build_artifact(tiny_build, "openvino", "fp32",
                            options=OpenVinoOptions(device="CPU", shapes="dynamic", sizes=((64, 96),)))
    assert folder != ov_fp32 and plan(tiny_build, "openvino", "fp32").up_to_date  # beside the default, kept
    options = _manifest(folder)["submodules"]["transformer"]["session_options"]
    assert options["compiled_model"] == "transformer.cpu.blob"
    assert [(s["size"], s["file"], s["shapes"]["hidden_states"]) for s in options["static_models"]] == [
        ("64x96", "transformer.64x96.cpu.blob", [2, 16, 8, 12])]
    first_block = _manifest(folder)["submodules"]["transformer_first_block"]["session_options"]["static_models"]
    assert first_block[0]["shapes"]["tail_residual"] == [2, 24, 32]  # 4x6 patches: every dim follows the size
    monkeypatch.setattr(ov.Core, "compile_model", lambda *a, **k: pytest.fail("compiled at run time"))
    pipe = Pipeline.load(folder)
    for height, width in ((64, 96), (64, 64)):  # the static blob, then the dynamic one
        image = pipe("a cat", height=height, width=width, num_inference_steps=1, seed=0, output_type="np")
        assert image.shape == (1, height, width, 3)
    assert pipe.sessions["transformer"].imported and len(pipe.sessions["transformer"].per_size) == 1


def test_a_blob_openvino_cannot_import_is_said_and_the_ir_compiled(ov_bf16, tmp_path, capsys):
    import shutil

    folder = shutil.copytree(ov_bf16, tmp_path / "artifact")
    (folder / "text_encoder.cpu.blob").write_bytes(b"not a compiled model")
    session = _session(folder, "text_encoder")
    assert not session.imported
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].endswith("); compiling the IR instead")
    assert said[0].startswith("[runners] text_encoder.xml: OpenVINO could not import text_encoder.cpu.blob "
                              "([CPU] Cannot import compiled blob: ")  # OpenVINO's reason, not its source line


def test_openvino_runner_imports_no_torch_diffusers_or_transformers(ov_bf16):
    from test_runner_isolation import assert_runs_without_build_libraries

    assert_runs_without_build_libraries(ov_bf16)


def test_missing_openvino_says_what_to_install(monkeypatch, ov_fp32):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else find_spec(name, *a))
    with pytest.raises(TargetError, match=r"needs the 'openvino' module, which is not installed: "
                                          r"pip install 'diffusion-aot\[openvino\]'"):
        get_target("openvino", "bf16")
    monkeypatch.setitem(sys.modules, "openvino", None)  # the runner's import fails
    with pytest.raises(RuntimeError, match=r"runs on OpenVINO, which is not installed .*diffusion-aot\[openvino\]"):
        Pipeline.load(ov_fp32)


def _engines(*args):
    return subprocess.run([sys.executable, "-m", "engines", *map(str, args)], capture_output=True, text=True)


@pytest.mark.parametrize("args, message", [
    (["--target", "ort", "--precision", "bf16"],
     "error: target 'ort' does not take precision 'bf16' (ONNX Runtime's CPU has no bf16 MatMul or Conv kernel); "
     "the targets that take it: openvino, trt, trt-rtx"),
    (["--target", "openvino", "--precision", "fp8"],
     "error: target 'openvino' does not take precision 'fp8'; the targets that take it: ort, trt, trt-rtx"),
    (["--target", "openvino", "--ov-device", "NPU7"],
     "error: OpenVINO device 'NPU7' is not present on this machine; it has: CPU"),
    (["--target", "openvino", "--ov-sizes", "128x128"],
     "error: --ov-sizes compiles the denoiser for a device at build time: add --ov-device CPU"),
    (["--target", "openvino", "--ov-device", "CPU", "--ov-sizes", "128x100"],
     "error: --ov-sizes 128x100: this export takes sides from 64 to 512 in steps of 16"),
])
def test_cli_errors_are_one_line(tiny_build, args, message):
    r = _engines(tiny_build, *args)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and r.stderr.startswith(message)
    assert not (tiny_build / "openvino-fp8").exists() and not (tiny_build / "ort-bf16").exists()


def test_list_passes_names_the_openvino_target_and_bf16():
    listed = _engines("--list-passes")
    assert listed.returncode == 0
    line = next(line for line in listed.stdout.splitlines() if line.startswith("target openvino "))
    assert line.startswith("target openvino (fp32, bf16, fp16, int8): passes fold_constants, infer_shapes, "
                           "remove_dead_nodes, fuse_qkv, fuse_attention; ")
    assert "; bf16: no passes, runtime INFERENCE_PRECISION_HINT=bf16;" in line
    assert line.endswith("; int8: no passes, runtime INFERENCE_PRECISION_HINT=bf16, int8 by its own quantizer")
    assert "precision int8: passes quantize_int8\n" in listed.stdout  # the precision's list names no target


# Each step cache on openvino bf16 and int8 against ort-fp32 with the same cache, sd3-tiny at SD3_CACHE_CALL
# (test_first_block_cache's call: first-block 0.38 caches 7 of 10 steps there). Measured on a Zen 3 (no AVX-512
# BF16: bf16 runs in fp32): bf16 71.4 and 70.0 dB (TaylorSeer, First-Block Cache), int8 34.0 and 34.0; the
# caches changed the images to 44.8, 51.9, 36.5 and 37.2 dB. The bounds are the image test's.
SD3_CACHE_CALL = dict(prompt="a photo of a cat", height=64, width=64, num_inference_steps=10, max_sequence_length=32,
                      guidance_scale=5.0, output_type="np")
CACHES = {"taylorseer": "taylorseer:interval=2,before=2,order=1", "first-block": "first-block:0.38"}
CACHE_MIN_PSNR = {"bf16": 34.0, "int8": 31.0}


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_caches_against_ort_fp32_with_the_same_cache(tiny_artifact, precision, cache, request):
    reference, ours = Pipeline.load(tiny_artifact), Pipeline.load(request.getfixturevalue(f"ov_{precision}"))
    call = dict(SD3_CACHE_CALL, latents=_latents(0, 1, 64, 64))
    uncached = ours(**call)
    ref, image = reference(**call, cache=CACHES[cache]), ours(**call, cache=CACHES[cache])
    stats, ref_stats = ours.cache_stats, reference.cache_stats
    psnr, change = _psnr(ref, image), _psnr(uncached, image)
    print(f"openvino-{precision} {cache}: {stats['full']} full, {stats['cached']} cached (ort-fp32 "
          f"{ref_stats['full']}, {ref_stats['cached']}); PSNR {psnr:.1f} dB against ort-fp32 with the cache, "
          f"{change:.1f} dB against itself uncached")
    assert stats["cached"] > 0 and change < 80  # the cache ran and changed the image
    assert psnr >= CACHE_MIN_PSNR[precision], psnr


@pytest.mark.parametrize("threads, cores, flags, capped", [
    (1, 2, {"avx512f", "amx_tile"}, True),
    (None, 1, {"avx512f", "amx_tile"}, True),  # one core: `taskset -c 0`
    (2, 2, {"avx512f", "amx_tile"}, False),
    (1, 2, {"avx512f", "avx512_bf16"}, False),  # no AMX: nothing to avoid
])
def test_one_thread_on_amx_caps_onednn_below_amx(monkeypatch, threads, cores, flags, capped):
    """OpenVINO 2026.4 dies with SIGFPE compiling sd3-tiny's bf16 T5 for one thread on an AMX CPU (this
    suite's workers, one thread each, died so on such a machine); below AMX the same graphs compile."""
    from runners.backends import openvino as backend

    variable, value = backend.ONE_THREAD_ISA_CAP
    monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(backend, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(backend.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert backend.avoid_one_thread_amx_crash(threads) is capped
    assert backend.os.environ.get(variable) == (value if capped else None)
    monkeypatch.setenv(variable, "AVX2")  # the user's own cap stays
    assert not backend.avoid_one_thread_amx_crash(1) and backend.os.environ[variable] == "AVX2"


def test_a_tiled_decode_compiles_each_tile_size_and_matches_the_dynamic_model(ov_fp32):
    """The VAE decoder is per-size too: a tiled decode (runners.tiling) meets up to four tile sizes (whole tiles, and
    the shorter ones at the right and bottom edges), compiles each, and decodes as one dynamic model does."""
    pipe = Pipeline.load(ov_fp32, submodules=["vae_decoder"])
    z = np.random.default_rng(0).standard_normal((1, 16, 24, 20)).astype(np.float32)
    per_size = pipe.sessions["vae_decoder"]
    got = pipe.vae_decode(z, tiling=True, tile_size=16)  # tiles every 12 latent pixels: sides 16 and 12, 16 and 8
    assert per_size.compiles == 4 and len(per_size.per_size) == 2
    pipe.sessions["vae_decoder"] = OpenVinoSession(ov_fp32 / "vae_decoder.xml", session_options={"shapes": "dynamic"},
                                                   session_config={"INFERENCE_PRECISION_HINT": "f32"})
    expected = pipe.vae_decode(z, tiling=True, tile_size=16)
    assert got.shape == (1, 3, 192, 160)
    np.testing.assert_allclose(got, expected, atol=SUBMODULE_RTOL * np.abs(expected).max())


def test_two_threads_on_one_openvino_pipeline_take_turns(ov_fp32):
    """An OpenVINO engine has one infer request (Backend.concurrent is False): a second call in another thread
    waits for the first (runners/call.py) and each gets the image it gets alone, where two calls at once on one
    request would fail or mix their tensors."""
    import threading

    pipe = Pipeline.load(ov_fp32)
    calls = [dict(prompt=p, height=64, width=64, num_inference_steps=3, seed=k, output_type="np")
             for k, p in enumerate(("a photo of a cat", "a red fox in the snow"))]
    alone = [pipe(**call) for call in calls]
    together, errors = [None, None], []

    def run(k):
        try:
            together[k] = pipe(**calls[k])
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(np.array_equal(got, image) for got, image in zip(together, alone))
    assert np.abs(alone[0] - alone[1]).max() > 0.01
