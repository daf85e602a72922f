"""The pass contract (engines/passes/base.py): `requires` refuses what a pass cannot work on,
`ensures` keeps the graph's inputs and outputs, each pass sets `modified` itself, the context is
given to the pass, and a build that succeeds prints none of what the libraries say."""
from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from engines.passes import PASSES, GraphPass, PassContext, PassFailed, Report, run_passes, show_library_output
from engines.passes.ort_tools import NAME_SCOPES_KEY

FLOAT = ir.DataType.FLOAT


def _linear(shaped: bool = True, scope: str = "transformer.proj") -> ir.Model:
    """y = Softmax(Relu(x @ W)): one MatMul with a constant weight, exported from module `scope`."""
    x = ir.Value(name="x", shape=ir.Shape(["batch", 8]), type=ir.TensorType(FLOAT))
    w = ir.Value(name="w", shape=ir.Shape([8, 16]), type=ir.TensorType(FLOAT),
                 const_value=ir.tensor(np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32), name="w"))
    matmul = ir.node("MatMul", [x, w], name="proj")
    matmul.metadata_props[NAME_SCOPES_KEY] = repr([scope])
    relu = ir.node("Relu", [matmul.outputs[0]], name="relu")
    softmax = ir.node("Softmax", [relu.outputs[0]], attributes={"axis": -1}, name="softmax")
    for node, name in ((matmul, "h"), (relu, "r"), (softmax, "y")):
        node.outputs[0].name, node.outputs[0].dtype = name, FLOAT
        if shaped:
            node.outputs[0].shape = ir.Shape(["batch", 16])
    graph = ir.Graph([x], [softmax.outputs[0]], nodes=[matmul, relu, softmax], initializers=[w], opset_imports={"": 20})
    return ir.Model(graph, ir_version=10)


class _RenamesOutput(GraphPass):
    name = "renames_output"

    def call(self, model):
        model.graph.outputs[0].name = "renamed"
        return Report(model, modified=True)


class _DropsRank(GraphPass):
    name = "drops_rank"

    def call(self, model):
        model.graph.outputs[0].shape = ir.Shape(["batch", 4, 4])
        return Report(model, modified=True)


@pytest.mark.parametrize("cls, what", [(_RenamesOutput, "renamed"), (_DropsRank, r"\('y', FLOAT, 3\)")])
def test_ensures_names_the_pass_that_changed_the_outputs(cls, what, monkeypatch):
    monkeypatch.setitem(PASSES, cls.name, cls)
    with pytest.raises(PassFailed, match=rf"pass '{cls.name}' failed on m .*pass '{cls.name}' changed the outputs of m "
                                         rf"from .*{what}.*: a pass must keep the graph's input and output names"):
        run_passes(_linear(), [cls.name], "m", context=PassContext("m"))


def test_ensures_accepts_a_rank_that_becomes_known():
    model = _linear()
    model.graph.outputs[0].shape = None
    _, reports = run_passes(model, ["infer_shapes"])
    assert model.graph.outputs[0].shape == ir.Shape(["batch", 16])
    assert reports[0]["counts"] == {"shapes_added": 0, "shapes_refined": 0}


def test_fuse_attention_refuses_a_graph_without_shapes_and_infer_shapes_fixes_it():
    with pytest.raises(PassFailed, match=r"pass 'fuse_attention' reads tensor shapes, and 3 of the 3 tensors of m "
                                         r"have none \(e.g. h, r, y\): run infer_shapes before it"):
        run_passes(_linear(shaped=False), ["fuse_attention"], "m", context=PassContext("m"))
    _, reports = run_passes(_linear(shaped=False), ["infer_shapes", "fuse_attention"])
    assert reports[0]["counts"]["shapes_added"] == 2  # h and r; y is the graph's output
    assert reports[1]["modified"] is False and reports[1]["counts"]["attentions_fused"] == 0


@pytest.mark.parametrize("name", ["quantize_fp8", "to_fp16"])
def test_passes_that_measure_refuse_to_run_without_calibration(name):
    assert PASSES[name].needs_calibration
    with pytest.raises(PassFailed, match=rf"pass '{name}' measures the model on calibration inputs, and none were "
                                         r"given for m \(engines.calibration.collect records them\)"):
        run_passes(_linear(), [name], "m", context=PassContext("m"))


def test_a_quantizer_that_quantized_nothing_reports_unmodified():
    keep = PassContext("m", {"quantization": {"keep_scopes": ["proj"]}})
    _, kept = run_passes(_linear(), ["quantize_int8"], "m", context=keep)
    assert kept[0]["counts"] == {"nodes_removed": 0, "linear_int8": 0, "linear_kept_float": 1}
    assert kept[0]["modified"] is False
    _, done = run_passes(_linear(), ["quantize_int8"], "m", context=PassContext("m"))
    assert done[0]["counts"]["linear_int8"] == 1 and done[0]["modified"] is True


def test_each_pass_holds_the_context_it_was_given():
    first, second = PassContext("a"), PassContext("b")
    assert PASSES["fuse_qkv"](first).context is first and PASSES["fuse_qkv"](second).context is second
    assert not any("context" in vars(cls) for cls in PASSES.values())  # no class-wide context to overwrite


def _noisy(model):
    import logging
    import warnings

    print("[W] colored module is not installed")
    logging.getLogger("some.library").warning("a library warning")
    warnings.warn("a library UserWarning")
    return Report(model, modified=False)


def test_library_output_is_kept_back_on_success_and_shown_with_verbose(monkeypatch, capfd):
    monkeypatch.setattr(PASSES["remove_dead_nodes"], "call", lambda self, model: _noisy(model))
    run_passes(_linear(), ["remove_dead_nodes"], log=print)
    out, err = capfd.readouterr()
    assert (out, err) == ("model: remove_dead_nodes: nothing to report\n", "")
    show_library_output(True)
    try:
        run_passes(_linear(), ["remove_dead_nodes"])
    finally:
        show_library_output(False)
    out, err = capfd.readouterr()
    assert "colored module" in out  # (pytest itself holds the logged and warned lines here)


def test_a_failed_pass_carries_what_the_libraries_said(monkeypatch):
    def fails(self, model):
        print("[W] Inference failed: the reason")
        raise RuntimeError("injected")

    monkeypatch.setattr(PASSES["remove_dead_nodes"], "call", fails)
    with pytest.raises(PassFailed, match=r"RuntimeError: injected\nthe libraries said:\n\[W\] Inference failed: "
                                         r"the reason"):
        run_passes(_linear(), ["remove_dead_nodes"])


def test_the_ort_pipeline_on_sd3_tiny_prints_our_lines_only(tiny_build, capfd):
    """The default `make engines` passes on every sd3-tiny graph (fold_constants' polygraphy printed
    "colored module is not installed" and "Inference failed ... __weight_held_by_diffusion_aot__"
    for the transformer): the output holds our progress lines and nothing else."""
    from engines.targets import get_target

    names = list(get_target("ort", "fp32").passes)
    for sub in ("text_encoder", "transformer", "vae_decoder"):
        run_passes(ir.load(tiny_build / "onnx" / f"{sub}.onnx"), names, sub, log=lambda m: print(f"[engines] {m}"))
    out, err = capfd.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert len(lines) == 3 * len(names) and all(line.startswith("[engines] ") for line in lines), out
