"""Every graph pass: outputs agree before and after (fp32, 1e-5 of the output scale), and the
report's counts are what the model's configs say they must be."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from engines.passes import PASSES, PassContext, PassFailed, run_passes
from engines.passes.rewrite import replace_uses
from engines.targets import get_target
from export.families import FAMILIES
from export.onnx_export import example_inputs
from passes_oracle import expected_counts

PASS_RTOL = 1e-5
COMPONENT = {"vae_decoder": "vae", "vae_encoder": "vae", "transformer_first_block": "transformer", "unet_shallow": "unet"}


def _run(model: ir.Model, feeds: dict, tmp_path) -> list[np.ndarray]:
    path = tmp_path / "model.onnx"
    ir.save(model, path)
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def _check(onnx_dir, source, names, tmp_path, atol: float | None = None) -> dict[str, dict]:
    """Run `names` on every submodule of `onnx_dir`, planned at each probe's dims; assert parity
    (`atol`, else 1e-5 of the output scale); return {submodule: {pass: counts}}."""
    manifest = json.loads((onnx_dir / "manifest.json").read_text())
    counts = {}
    for spec in (s for s in FAMILIES[manifest["model"]["family"]].submodules if s.applies(source)):
        sub = manifest["submodules"][spec.name]
        for probe in sub["export"]["parity"]:
            arrays = example_inputs(spec, probe["dims"], manifest["constants"], seed=1)
            feeds = {t.name: a for t, a in zip(spec.inputs, arrays)}
            ref = _run(ir.load(onnx_dir / sub["file"]), feeds, tmp_path)
            context = PassContext(spec.name, dims={**manifest["constants"], **probe["dims"]})
            model, reports = run_passes(ir.load(onnx_dir / sub["file"]), names, spec.name, context=context)
            out = _run(model, feeds, tmp_path)
            for r, o in zip(ref, out):
                bound = atol if atol is not None else PASS_RTOL * max(1.0, float(np.abs(r).max()))
                assert np.abs(r - o).max() <= bound, (spec.name, names, probe["dims"], np.abs(r - o).max())
        counts[spec.name] = {r["name"]: r["counts"] for r in reports}
        counts[spec.name]["config"] = source.config(COMPONENT.get(spec.name, spec.name))
        counts[spec.name]["outputs"] = tuple(t.name for t in spec.outputs)
    return counts


@pytest.mark.parametrize("name", ["fold_constants", "infer_shapes", "remove_dead_nodes"])
def test_library_pass_parity(tiny_build, tiny_source, name, tmp_path):
    counts = _check(tiny_build / "onnx", tiny_source, [name], tmp_path)
    assert {sub: c[name] for sub, c in counts.items()} == LIBRARY_PASS_COUNTS[name]


# The library passes' exact counts on sd3-tiny's export with the locked exporter (constraints.txt):
# a changed count means the exporter's graph or the library changed, which the lock makes deliberate.
# fold_constants: each CLIP computes its position ids and causal mask from constants (6 nodes into 5
# constants); the transformer and the VAEs have a few constant-only nodes the exporter left.
# infer_shapes: the dynamo export gives every tensor a rank, and ONNX's inference fills in dims it left
# unknown (the attention reshapes' [?, ?, ?] becomes [batch, 4, 8, 77]). polygraphy's version of the
# pass counted value_info entries instead (2, 2, 1, 0, 1, 2). In the ort pipeline it refines nothing:
# fold_constants' polygraphy has inferred shapes already. The export leaves no dead node.
_NONE = {"nodes_removed": 0, "initializers_removed": 0}
LIBRARY_PASS_COUNTS = {
    "fold_constants": {
        "text_encoder": {"nodes_removed": 6, "constants_added": 5},
        "text_encoder_2": {"nodes_removed": 6, "constants_added": 5},
        "text_encoder_3": {"nodes_removed": 0, "constants_added": 0},
        "transformer": {"nodes_removed": 2, "constants_added": 2},
        "transformer_first_block": {"nodes_removed": 1, "constants_added": 1},
        "vae_decoder": {"nodes_removed": 1, "constants_added": 0},
        "vae_encoder": {"nodes_removed": 1, "constants_added": 0}},
    "infer_shapes": {sub: {"shapes_added": 0, "shapes_refined": n} for sub, n in
                     {"text_encoder": 18, "text_encoder_2": 18, "text_encoder_3": 0, "transformer": 12,
                      "transformer_first_block": 6, "vae_decoder": 94, "vae_encoder": 62}.items()},
    "remove_dead_nodes": {sub: _NONE for sub in ("text_encoder", "text_encoder_2", "text_encoder_3", "transformer",
                                                 "transformer_first_block", "vae_decoder", "vae_encoder")},
}


@pytest.mark.parametrize("name", ["fuse_qkv", "fuse_attention"])
def test_fusion_parity_and_counts_sd3(tiny_build, tiny_source, name, tmp_path):
    counts = _check(tiny_build / "onnx", tiny_source, [name], tmp_path)
    assert set(counts) == {"text_encoder", "text_encoder_2", "text_encoder_3", "transformer",
                           "transformer_first_block", "vae_decoder", "vae_encoder"}
    for sub, c in counts.items():
        for key, value in expected_counts(sub, c["config"], c["outputs"])[name].items():
            assert c[name][key] == value, (sub, name, key)
        assert c[name]["nodes_removed"] > 0


def test_masked_joint_attention_fuses(qwen_image_tiny_build, tmp_path):
    """Qwen-Image's joint attention masks the text's padded keys with a (B, 1, 1, L) additive mask, which
    MultiHeadAttention takes expanded over the queries: every layer fuses (it fused none before), equal at both
    probes with padded masks (example_inputs pads them). Its text encoder's attention (causal, then each query's
    output multiplied by whether it may see any key) fuses too (it fused none before); its VAE's is another
    pattern, left as it is."""
    counts = _check(qwen_image_tiny_build.folder / "onnx", qwen_image_tiny_build.source, ["fuse_attention"], tmp_path)
    fused = {sub: c["fuse_attention"]["attentions_fused"] for sub, c in counts.items()}
    assert fused == {"text_encoder": counts["text_encoder"]["config"]["text_config"]["num_hidden_layers"],
                     "transformer": counts["transformer"]["config"]["num_layers"],
                     "transformer_first_block": 1, "vae_decoder": 0, "vae_encoder": 0}


def test_llm_encoder_attention_keeps_its_row_rule(qwen_image_tiny_build, tmp_path):
    """A left-padded prompt (Mistral's) has queries allowed no key, whose attention output the encoders' graphs
    set to 0 after the softmax (export/families/llm_encoder.py). Fused, that multiplier stays: equal to the
    unfused graph on a left-padded mask, where the padded rows' output without it is their values' mean."""
    onnx_dir = qwen_image_tiny_build.folder / "onnx"
    manifest = json.loads((onnx_dir / "manifest.json").read_text())
    spec = next(s for s in FAMILIES[manifest["model"]["family"]].submodules if s.name == "text_encoder")
    dims = manifest["submodules"]["text_encoder"]["export"]["parity"][0]["dims"]
    ids, _ = example_inputs(spec, dims, manifest["constants"], seed=1)
    mask = (np.arange(ids.shape[1]) >= ids.shape[1] // 2).astype(np.int64)[None].repeat(ids.shape[0], 0)
    feeds = {"input_ids": ids, "attention_mask": mask}
    context = PassContext("text_encoder", dims={**manifest["constants"], **dims})
    model, _ = run_passes(ir.load(onnx_dir / "text_encoder.onnx"), ["fuse_attention"], "text_encoder",
                          context=context)
    (ref,), (fused,) = _run(ir.load(onnx_dir / "text_encoder.onnx"), feeds, tmp_path), _run(model, feeds, tmp_path)
    assert np.abs(ref - fused).max() <= PASS_RTOL * np.abs(ref).max()
    attentions = [n for n in model.graph if n.op_type == "MultiHeadAttention"]
    rows = [u.node for n in attentions for u in n.outputs[0].uses() if u.node.op_type == "Mul"]
    assert len(rows) == len(attentions) == qwen_image_tiny_build.source.config("text_encoder")["text_config"][
        "num_hidden_layers"]
    for mul in rows:  # without the multipliers, the padded rows differ
        replace_uses(mul.outputs[0], mul.inputs[0])
    (dropped,) = _run(model, feeds, tmp_path)
    assert np.abs(ref - dropped).max() > 1e-3


def test_attention_holding_its_scores_fused_in_head_groups(qwen_image_tiny_build, tiny_build, tiny_source,
                                                           monkeypatch, tmp_path):
    """With a bias or a mask, ONNX Runtime's fused attention holds its (B, N, S, L) probabilities; past
    SCORES_BOUND at the plan dims its heads are fused in groups, one node each, equal to the whole. With the bound
    at one byte every such attention splits: Qwen-Image's key mask (shared by the groups), T5's position bias (split
    with its heads), CLIP's and the Qwen LLM's causal masks; the attentions without either (flash attention) stay
    whole."""
    from engines.passes import fuse_attention

    monkeypatch.setattr(fuse_attention, "SCORES_BOUND", 1)
    qwen = _check(qwen_image_tiny_build.folder / "onnx", qwen_image_tiny_build.source, ["fuse_attention"], tmp_path)
    sd3 = _check(tiny_build / "onnx", tiny_source, ["fuse_attention"], tmp_path)

    def grouped(counts):
        return {sub: c["fuse_attention"]["attentions_in_head_groups"] for sub, c in counts.items()}

    def fused(counts, sub):
        return counts[sub]["fuse_attention"]["attentions_fused"]

    assert grouped(qwen) == {"text_encoder": fused(qwen, "text_encoder"), "transformer": fused(qwen, "transformer"),
                             "transformer_first_block": 1, "vae_decoder": 0, "vae_encoder": 0}
    assert grouped(sd3) == {**{sub: fused(sd3, sub) for sub in ("text_encoder", "text_encoder_2", "text_encoder_3")},
                            "transformer": 0, "transformer_first_block": 0, "vae_decoder": 0, "vae_encoder": 0}
    # the groups' outputs are typed: ONNX's inference (to_fp16 runs it, then reads every type) does not know the op
    onnx_dir = qwen_image_tiny_build.folder / "onnx"
    dims = json.loads((onnx_dir / "manifest.json").read_text())["submodules"]["transformer"]["export"]["parity"][0]
    model, _ = run_passes(ir.load(onnx_dir / "transformer.onnx"), ["infer_shapes", "fuse_attention", "infer_shapes"],
                          "transformer", context=PassContext("transformer", dims=dims["dims"]))
    assert all(v.dtype is not None for node in model.graph for v in node.outputs)


def test_memory_passes_leave_every_output_unchanged(tiny_build, tiny_source, tmp_path):
    """fp32, max abs diff <= 1e-6 on every submodule at both export probes (the issue's bound)."""
    counts = _check(tiny_build / "onnx", tiny_source, ["fuse_elementwise", "schedule_memory", "remat"], tmp_path,
                    atol=1e-6)
    for sub, c in counts.items():
        assert c["fuse_elementwise"]["silus"] == expected_counts(sub, c["config"], c["outputs"])["fuse_elementwise"]["silus"], sub
        assert c["schedule_memory"]["peak_after"] <= c["schedule_memory"]["peak_before"], sub
        assert c["remat"]["peak_after"] <= c["remat"]["peak_before"], sub


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_fusions_and_memory_passes_on_the_unet_families(family, request, tmp_path):
    """Every fusion and memory pass on SD1.5 and SDXL: parity at both probes, and the counts the
    configs imply (the UNet's self-attention q/k/v, the cross-attention k/v and time projections
    that read one tensor each, 2 attentions per transformer block)."""
    build = request.getfixturevalue(f"{family}_tiny_build")
    names = ["fuse_qkv", "fuse_attention", "fuse_elementwise", "schedule_memory", "remat"]
    counts = _check(build.folder / "onnx", build.source, names, tmp_path)
    assert counts["unet"]["fuse_qkv"]["groups"] == {"sd15": 16, "sdxl": 17}[family] + 2  # by hand, for the oracle
    for sub, c in counts.items():
        expected = expected_counts(sub, c["config"], c["outputs"])
        for name in ("fuse_qkv", "fuse_attention", "fuse_elementwise"):
            assert c[name] == {**c[name], **expected[name]}, (sub, name)
        assert c["remat"]["peak_after"] <= c["schedule_memory"]["peak_before"], sub


@pytest.fixture(scope="module")
def sd35_onnx(tmp_path_factory, shared_root, tiny_build):
    """SD3.5's transformer: per-head RMS norm of q and k, and a second attention in block 0 (its text
    encoders, sd3-tiny's, taken from that export)."""
    from export.api import export_model
    from export.source import resolve

    source = resolve("sd3.5-tiny")
    return export_model(source, tmp_path_factory.mktemp("sd3.5-tiny"), reuse_from=shared_root), source


def test_fusions_with_qk_norm_and_dual_attention(sd35_onnx, tmp_path):
    onnx_dir, source = sd35_onnx
    assert source.config("transformer")["qk_norm"] == "rms_norm"
    counts = _check(onnx_dir, source, ["fuse_qkv", "fuse_attention"], tmp_path)["transformer"]
    expected = expected_counts("transformer", counts["config"])
    assert expected["fuse_qkv"]["groups"] == 2 * 2 + 1 + 1  # the dual-attention block adds one group
    assert counts["fuse_qkv"] == {**counts["fuse_qkv"], **expected["fuse_qkv"]}
    assert counts["fuse_attention"] == {**counts["fuse_attention"], **expected["fuse_attention"]}


def test_fused_weights_stay_under_the_cap(tiny_build, monkeypatch, tmp_path):
    """A group whose fused weight would pass MAX_FUSED_BYTES becomes consecutive groups under it
    (sd3-tiny's adaLN projections, capped at twice the largest of them): same outputs, more groups,
    every fused weight within the cap."""
    from engines.passes import fuse_qkv

    model = ir.load(tiny_build / "onnx" / "transformer.onnx")
    groups = fuse_qkv.find_groups(model.graph)
    widest = max(groups, key=lambda g: sum(m.weight.const_value.nbytes for m in g))
    member = max(m.weight.const_value.nbytes for m in widest)
    assert len(widest) > 2
    monkeypatch.setattr(fuse_qkv, "MAX_FUSED_BYTES", 2 * member)
    capped = fuse_qkv.find_groups(model.graph)
    assert len(capped) > len(groups)
    feeds = {v.name: np.random.default_rng(0).standard_normal(
        [d if isinstance(d, int) else 2 for d in v.shape], dtype=np.float32) for v in model.graph.inputs}
    feeds = {k: (a * 100).round().astype(np.int64) if model.graph.inputs[i].dtype == ir.DataType.INT64 else a
             for i, (k, a) in enumerate(feeds.items())}
    ref = _run(model, feeds, tmp_path)
    fused, reports = run_passes(model, ["fuse_qkv"], "transformer")
    assert reports[0]["counts"]["groups"] == len(capped)
    sizes = [v.const_value.nbytes for name, v in fused.graph.initializers.items()
             if name.startswith("qkv_fused_") and name.endswith(".weight")]
    assert len(sizes) == len(capped) and max(sizes) <= 2 * member
    for r, o in zip(ref, _run(fused, feeds, tmp_path)):
        assert np.abs(r - o).max() <= PASS_RTOL * max(1.0, float(np.abs(r).max()))


def test_qkv_weights_stay_lazy_and_external(tiny_build, tmp_path):
    """A graph whose weights are external data goes through every graph pass without them being
    read: they stay memory-mapped references, and fused weights are computed at save time. (The
    precision passes convert the weights themselves, so they read them: tests/test_precision.py.)"""
    import onnx

    src = tmp_path / "src"
    src.mkdir()
    proto = onnx.load(str(tiny_build / "onnx" / "transformer.onnx"))
    onnx.save_model(proto, str(src / "transformer.onnx"), save_as_external_data=True,
                    location="transformer.onnx.data", size_threshold=1024)
    del proto
    cwd = os.getcwd()
    os.chdir(tmp_path)  # a library that read the data relative to the working dir would fail here
    try:
        model, reports = run_passes(ir.load(src / "transformer.onnx"), get_target("ort", "fp32").passes)
    finally:
        os.chdir(cwd)
    big = [v.const_value for v in model.graph.initializers.values() if v.const_value.nbytes > 1024]
    kinds = {type(t).__name__ for t in big}
    assert kinds <= {"ExternalTensor", "LazyTensor"}, kinds
    assert "LazyTensor" in kinds  # the fused weights
    assert {r["name"]: r["counts"]["groups"] for r in reports if r["name"] == "fuse_qkv"} == {"fuse_qkv": 5}


def test_failure_names_pass_submodule_and_previous(tiny_build, monkeypatch):
    def boom(self, model):
        raise RuntimeError("injected")

    monkeypatch.setattr(PASSES["fuse_qkv"], "call", boom)
    model = ir.load(tiny_build / "onnx" / "vae_decoder.onnx")
    with pytest.raises(PassFailed, match=r"pass 'fuse_qkv' failed on vae_decoder "
                                         r"\(passes already run: remove_dead_nodes\): RuntimeError: injected"):
        run_passes(model, ["remove_dead_nodes", "fuse_qkv"], "vae_decoder")


def _engines(*args):
    return subprocess.run([sys.executable, "-m", "engines", *map(str, args)], capture_output=True, text=True)


def test_cli_lists_passes_and_refuses_unknown(tiny_build):
    listed = _engines("--list-passes")
    assert listed.returncode == 0
    for name in PASSES:
        assert name in listed.stdout
    assert "target ort (fp32, fp16, int8, fp8): passes fold_constants" in listed.stdout
    assert "precision fp8: passes to_fp16; the denoiser: quantize_fp8" in listed.stdout
    bad = _engines(tiny_build, "--passes", "fuse_qkv,fuse_everything")
    assert bad.returncode == 2
    assert "unknown pass 'fuse_everything'; known passes: fold_constants" in bad.stderr


def test_cli_passes_override_is_recorded(tiny_build, tmp_path):
    import shutil

    build = tmp_path / "build"
    shutil.copytree(tiny_build / "onnx", build / "onnx")
    done = _engines(build, "--passes", "fuse_qkv")
    assert done.returncode == 0, done.stderr
    manifest = json.loads((build / "ort-fp32" / "manifest.json").read_text())
    assert manifest["passes"] == ["fuse_qkv"]
    assert manifest["submodules"]["transformer"]["passes"][0]["counts"]["groups"] == 5
    none = _engines(build, "--passes", "", "--force")
    assert none.returncode == 0, none.stderr
    manifest = json.loads((build / "ort-fp32" / "manifest.json").read_text())
    assert manifest["passes"] == [] and manifest["submodules"]["transformer"]["passes"] == []


def test_default_artifact_records_every_pass(tiny_artifact, tiny_source):
    """The ORT target builds through its pass pipeline by default; the manifest keeps each report."""
    from engines.targets import get_target

    manifest = json.loads((tiny_artifact / "manifest.json").read_text())
    assert manifest["passes"] == list(get_target("ort", "fp32").passes)
    assert "fuse_attention" in manifest["passes"]
    for sub, entry in manifest["submodules"].items():
        assert [r["name"] for r in entry["passes"]] == manifest["passes"]
        counts = {r["name"]: r["counts"] for r in entry["passes"]}
        config = tiny_source.config(COMPONENT.get(sub, sub))
        for name, expected in expected_counts(sub, config).items():
            if name in manifest["passes"]:
                assert {k: counts[name][k] for k in expected} == expected, (sub, name)


# to_bf16 on the TensorRT targets' graphs of sd3-tiny: the bf16 graph run by OpenVINO (the one CPU
# runtime here that runs a bf16 ONNX graph) against ONNX Runtime fp32 on the export. Measured
# (OpenVINO 2026.4.1): relative L2 error 0.7% (text encoders) to 1.9% (VAE decoder), at the first
# export probe. Bounds: 2x the measured worst, and 0.2% from below: the graph really is bf16.
BF16_MAX_REL_ERR, BF16_MIN_REL_ERR = 4e-2, 2e-3
# First-Block Cache's residual outputs are one hidden stream minus another: the streams' bf16 error over
# the smaller norm of their difference. Measured: tail_residual 11.5% (6.3% on a CPU without bf16, where
# OpenVINO computes the bf16 graph in fp32), first_block_residual 5.1% there. Bound: about 2x the worst.
BF16_RESIDUAL_MAX_REL_ERR = 0.25
RESIDUALS = ("tail_residual", "first_block_residual")
# Per submodule: weights and activations made bf16, and the nodes kept fp32 (T5's RMS norms'
# ReduceMean, the VAE's group norms, the attentions' Softmax).
TO_BF16_COUNTS = {
    "text_encoder": {"weights_bf16": 20, "fp32_nodes": 2}, "text_encoder_2": {"weights_bf16": 19, "fp32_nodes": 2},
    "text_encoder_3": {"weights_bf16": 22, "fp32_nodes": 7}, "transformer": {"weights_bf16": 47, "fp32_nodes": 2},
    "transformer_first_block": {"weights_bf16": 31, "fp32_nodes": 1},
    "vae_decoder": {"weights_bf16": 65, "fp32_nodes": 23}, "vae_encoder": {"weights_bf16": 51, "fp32_nodes": 15},
}


def test_to_bf16_parity_and_counts(tiny_build, tmp_path):
    ov = pytest.importorskip("openvino")
    from engines.passes.to_bf16 import FP32_OPS

    manifest = json.loads((tiny_build / "onnx" / "manifest.json").read_text())
    names = [*get_target("trt-rtx", "bf16").passes, "to_bf16"]
    for spec in FAMILIES["sd3"].submodules:
        sub = manifest["submodules"][spec.name]
        probe = sub["export"]["parity"][0]
        feeds = {t.name: a for t, a in zip(spec.inputs, example_inputs(spec, probe["dims"], manifest["constants"], seed=1))}
        ref = _run(ir.load(tiny_build / "onnx" / sub["file"]), feeds, tmp_path)
        model, reports = run_passes(ir.load(tiny_build / "onnx" / sub["file"]), names, spec.name,
                                    context=PassContext(spec.name, sub))
        counts = reports[-1]["counts"]
        assert {k: counts[k] for k in TO_BF16_COUNTS[spec.name]} == TO_BF16_COUNTS[spec.name], spec.name
        for node in model.graph:  # every float computation is bf16 but the kept ones
            floats = {v.dtype for v in node.outputs if v.dtype in (ir.DataType.FLOAT, ir.DataType.BFLOAT16)}
            if node.op_type != "Cast" and floats:
                assert floats == {ir.DataType.FLOAT if node.op_type in FP32_OPS else ir.DataType.BFLOAT16}, node
        path = tmp_path / f"{spec.name}-bf16.onnx"
        ir.save(model, path, external_data=f"{spec.name}-bf16.onnx.data")
        out = ov.Core().compile_model(ov.convert_model(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})(feeds)
        for i, (output, r) in enumerate(zip(spec.outputs, ref)):  # float32 still, in the export's order
            assert out[i].dtype == np.float32 and out[i].shape == r.shape
            err = float(np.linalg.norm(out[i] - r) / np.linalg.norm(r))
            bound = BF16_RESIDUAL_MAX_REL_ERR if output.name in RESIDUALS else BF16_MAX_REL_ERR
            assert BF16_MIN_REL_ERR < err <= bound, (spec.name, output.name, err)
