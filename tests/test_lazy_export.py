"""Export from lazily loaded weights (traced weightless, weights attached from the checkpoint and
streamed when written) gives the graph torch's ordinary export of the loaded module gives: the
same nodes, wiring, attributes and weights, for every sd3-tiny submodule. The ordinary export runs
the exporter's full optimizer; ours skips its quadratic rules (export.onnx_export.optimize), so the
same graphs also show that those rules rewrite nothing here."""
from __future__ import annotations

import functools
import re

import numpy as np
import onnx_ir as ir
import pytest
import torch

from conftest import manifest
from export.families import FAMILIES
from export.lazy_weights import WeightsError, attach_weights, checkpoint_index
from export.onnx_export import SKIPPED_REWRITE_RULES, export_weightless, trace, traced_graph, wrapped
from runners.adapters.provenance import WeightTable
from export.shapes import dim_ranges, probe_dims

# Every test here traces sd3-tiny submodules through the exporter itself: the export tier.
pytestmark = pytest.mark.export

SD3 = FAMILIES["sd3"]
_GENERATED = re.compile(r"val_\d+")


def canonical(model: ir.Model):
    """(nodes, {initializer: values}) with the exporter's numbered names (val_12) renamed by first
    appearance. Tracing fake weights draws one more number from the exporter's name counter in the
    VAE encoder, which shifts those names by one; every other name (weights, inputs, the names
    torch gives its ops) is compared as it is."""
    rename = {}

    def name(value):
        if value is None:
            return None
        if _GENERATED.fullmatch(value.name):
            return rename.setdefault(value.name, f"generated_{len(rename)}")
        return value.name

    def value(attribute):  # as written: ONNX stores float attributes in float32
        v = attribute.value
        if isinstance(v, float) or (isinstance(v, (list, tuple)) and v and isinstance(v[0], float)):
            return repr(np.float32(v).tolist())
        return repr(v)

    nodes = [(n.op_type, n.domain, [name(v) for v in n.inputs], [name(v) for v in n.outputs],
              sorted((k, value(a)) for k, a in n.attributes.items())) for n in model.graph]
    weights = {name(v): v.const_value.numpy() for v in model.graph.initializers.values()}
    return nodes, weights


@pytest.fixture(scope="module")
def setting(tiny_source):
    constants = SD3.constants(tiny_source)
    probe = probe_dims(tiny_source.entry, SD3, constants)[0]
    return constants, set(dim_ranges(tiny_source.entry, SD3, constants)), probe


@pytest.fixture(scope="module")
def lazy_export(tiny_source, setting):
    """export_weightless(name, dtype) of an sd3-tiny submodule, traced once for the tests here that read it
    (about half a minute each)."""
    constants, dynamic, probe = setting

    @functools.cache
    def export(name: str, dtype: str = "float32"):
        spec = next(s for s in SD3.submodules if s.name == name)
        return export_weightless(spec, tiny_source, dtype, constants, dynamic, probe)
    return export


def test_the_skipped_rewrite_rules_are_onnxscripts():
    """A rule onnxscript renames or drops would be skipped no more (or never again): say so."""
    from onnxscript import rewriter

    names = {getattr(rule, "name", None) for rule in rewriter._DEFAULT_REWRITE_RULES}
    assert set(SKIPPED_REWRITE_RULES) <= names, sorted(n for n in names if n)


def test_the_optimizer_still_rewrites():
    """The rules the optimizer tries only on their pattern's operator (export.onnx_export._RootChecked) rewrite:
    two transposes that cancel, and a cast to the type it has, are gone."""
    import onnx
    from onnx import TensorProto, helper

    from export.onnx_export import optimize

    graph = helper.make_graph([helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]),
                               helper.make_node("Transpose", ["t"], ["u"], perm=[1, 0]),
                               helper.make_node("Cast", ["u"], ["c"], to=TensorProto.FLOAT),
                               helper.make_node("Relu", ["c"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]))
    optimize(model)
    assert [node.op_type for node in model.graph] == ["Relu"]
    onnx.checker.check_model(ir.serde.serialize_model(model))


@pytest.mark.parametrize("name", [s.name for s in SD3.submodules])
def test_lazy_export_gives_the_ordinary_graph(tiny_source, tiny_build, setting, name):
    """The lazy graph is the session's export of it, as written (its weights read back from its file)."""
    from runners.manifest import load_onnx

    constants, dynamic, probe = setting
    spec = next(s for s in SD3.submodules if s.name == name)
    export = manifest(tiny_build / "onnx")["submodules"][name]
    lazy, counts = load_onnx(tiny_build / "onnx" / export["file"]), export["export"]["weights"]
    component = tiny_source.load(spec.component, **spec.load_kwargs).eval()
    ordinary, _ = traced_graph(spec, component, "float32", constants, dynamic, probe)  # cut, where it is, alike
    torch.onnx.ONNXProgram(ordinary, None).optimize()  # the exporter's whole optimizer
    assert counts["weights_mapped"] > 0 and counts["weights_converted"] == 0
    lazy_nodes, lazy_weights = canonical(lazy)
    nodes, weights = canonical(ordinary)
    assert lazy_nodes == nodes
    assert lazy_weights.keys() == weights.keys()
    for key, value in weights.items():
        np.testing.assert_array_equal(lazy_weights[key], value, err_msg=key)
    if name != "vae_decoder" and name != "vae_encoder":  # convolutions only: no linear layer to transpose
        assert counts["transposes_deferred"] > 0
    if name == "transformer_first_block":  # cut from the whole transformer's trace: block 0 is all it keeps
        blocks = {int(w.split(".")[2]) for w in weights if w.startswith("transformer.transformer_blocks.")}
        assert blocks == {0}


def test_graphs_sharing_a_trace_take_it_once():
    """Each graph but the last of a trace's key gets a copy (a cut changes it); the last, the trace; a graph of
    another key, a trace of its own; a graph linked instead of traced keeps none. The report names the graph that
    made a shared trace."""
    from export.onnx_export import SharedTraces

    class Model:
        def clone(self):
            return ("copy", self)

    graphs = {name: next(s for s in SD3.submodules if s.name == name)
              for name in ("transformer", "transformer_first_block", "vae_decoder")}
    traces, made = SharedTraces({"transformer": "k", "transformer_first_block": "k", "vae_decoder": "j"}), []
    make = lambda: made.append(Model()) or made[-1]  # noqa: E731
    first, second = traces.take(graphs["transformer"], make), traces.take(graphs["transformer_first_block"], make)
    assert len(made) == 1 and first == ("copy", made[0]) and second is made[0]
    assert traces.take(graphs["vae_decoder"], make) is made[1]
    assert [traces.maker(g) for g in graphs.values()] == [None, "transformer", None]
    linked = SharedTraces({"transformer": "k", "transformer_first_block": "k"})  # the first block linked instead
    linked.take(graphs["transformer"], make)
    linked.skip(graphs["transformer_first_block"])
    assert not linked._models  # nothing kept for a graph not traced


def test_a_trace_is_keyed_by_the_architecture_not_the_weights(tiny_source, tmp_path):
    """A transformer's graph and its first-block graph share the transformer's trace; another component of the same
    class and configuration (new weights: Wan 2.2 A14B's second transformer) shares it too, one configured
    otherwise, or kept in fp32 elsewhere, does not."""
    import dataclasses
    import json
    import shutil

    from export.api import _trace_key

    graphs = {s.name: s for s in SD3.submodules}
    key = functools.partial(_trace_key, src=tiny_source, **_key_settings(tiny_source))
    assert key(graphs["transformer"]) == key(graphs["transformer_first_block"]) != key(graphs["vae_decoder"])
    # what an fp16 export keeps in fp32 shapes the trace
    kept = dataclasses.replace(graphs["vae_decoder"], quantization={"fp32_scopes": ("decoder.mid_block",)})
    assert key(kept) != key(graphs["vae_decoder"])
    shutil.copy(tiny_source.folder / "model_index.json", tmp_path)
    config = json.loads((tiny_source.folder / "transformer" / "config.json").read_text())
    (tmp_path / "transformer").mkdir()
    other = dataclasses.replace(tiny_source, folder=tmp_path)
    for change, same in (({"_name_or_path": "elsewhere"}, True), ({"num_layers": config["num_layers"] + 1}, False)):
        (tmp_path / "transformer" / "config.json").write_text(json.dumps({**config, **change}))
        assert (_trace_key(graphs["transformer"], other, **_key_settings(tiny_source)) ==
                key(graphs["transformer"])) == same, change


def _key_settings(src) -> dict:
    constants = SD3.constants(src)
    return dict(settings=["settings"], ranges=dim_ranges(src.entry, SD3, constants),
                probes=probe_dims(src.entry, SD3, constants), constants=constants)


def test_a_trace_from_the_cache_gives_the_graph_traced(tiny_source, tmp_path):
    """An export that finds its trace in the trace cache (an earlier export's, of the same architecture) writes the
    graph the trace made, node for node and weight for weight, and says where its trace came from."""
    from export.api import _trace_key
    from export.onnx_export import CACHED, SharedTraces, export_submodule
    from export.trace_cache import TraceCache

    spec, settings = next(s for s in SD3.submodules if s.name == "transformer_first_block"), _key_settings(tiny_source)
    graphs = []
    for run in ("traced", "cached"):
        traces = SharedTraces({spec.name: _trace_key(spec, tiny_source, **settings)}, TraceCache(tmp_path / "traces"))
        out = tmp_path / run / f"{spec.name}.onnx"
        out.parent.mkdir()
        export_submodule(spec, tiny_source, "float32", settings["constants"], set(settings["ranges"]),
                         settings["probes"], out, traces=traces)
        assert traces.maker(spec) == (CACHED if run == "cached" else None)
        graphs.append(canonical(ir.load(out)))
    assert graphs[0][0] == graphs[1][0]
    assert graphs[0][1].keys() == graphs[1][1].keys()
    for name, value in graphs[0][1].items():
        np.testing.assert_array_equal(graphs[1][1][name], value, err_msg=name)


def test_a_trace_cache_that_cannot_be_written_fails_no_export(tmp_path):
    """A full disk or a read-only folder: the trace is not kept, the export goes on (and finds none next time)."""
    from export.trace_cache import TraceCache

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    cache = TraceCache(blocked / "traces")  # its folder cannot be made
    cache.store("key", ir.Model(ir.Graph([], [], nodes=[]), ir_version=10))
    assert cache.load("key") is None and blocked.read_text() == ""


def test_buffers_the_checkpoint_holds_come_from_it(lazy_export):
    """As from_pretrained loads them: a checkpoint's position embedding wins over the constructor's."""
    lazy, _, counts = lazy_export("transformer")
    assert counts["buffers_from_checkpoint"] == 1
    assert isinstance(lazy.graph.initializers["transformer.pos_embed.pos_embed"].const_value, ir.ExternalTensor)


def test_weights_stay_in_the_checkpoint_until_written(lazy_export):
    lazy, _, counts = lazy_export("text_encoder_3")
    kinds = {type(v.const_value).__name__ for v in lazy.graph.initializers.values() if v.const_value.nbytes > 4096}
    assert kinds <= {"ExternalTensor", "LazyTensor"}, kinds  # nothing large is held in memory
    assert counts["weights_converted"] == 0


def test_a_parameter_missing_from_the_checkpoint_is_named(tiny_source, setting):
    constants, dynamic, probe = setting
    spec = next(s for s in SD3.submodules if s.name == "text_encoder")
    module = wrapped(spec, tiny_source.load(spec.component).eval())
    model = trace(spec, module, constants, dynamic, probe, optimize=False).model
    index = checkpoint_index(tiny_source.folder / spec.component)
    index.pop("text_model.final_layer_norm.weight")
    with pytest.raises(WeightsError, match="final_layer_norm.weight is not in the checkpoint"):
        attach_weights(model, module, index, spec.component, WeightTable())


def test_weights_linked_from_elsewhere_are_read(tmp_path):
    """The hub's cache links a snapshot's files to its blobs (and a staged SD3.5 Large ControlNet links its
    own weights): onnx-ir refuses a symlink out of the folder it reads from, so the index names real paths."""
    from safetensors.numpy import save_file

    from export.lazy_weights import _stored

    weights = np.arange(6, dtype=np.float32).reshape(2, 3)
    (tmp_path / "blobs").mkdir()
    save_file({"proj.weight": weights}, tmp_path / "blobs" / "0123abcd")
    (tmp_path / "snapshot").mkdir()
    (tmp_path / "snapshot" / "model.safetensors").symlink_to(tmp_path / "blobs" / "0123abcd")
    index = checkpoint_index(tmp_path / "snapshot")
    assert index["proj.weight"]["file"] == tmp_path / "blobs" / "0123abcd"
    _, tensor = _stored("wrapper.proj.weight", ["wrapper.proj.weight"], index)
    np.testing.assert_array_equal(tensor.numpy(), weights)


def test_weights_of_a_hard_linked_checkpoint_are_read(tmp_path):
    """A checkpoint file with several hard links (a model manager's shared folders, a `cp -al` copy of the cache):
    onnx-ir refuses such a file where it guards a folder, so the weights are read by their file's own path."""
    import os

    from safetensors.numpy import save_file

    from export.lazy_weights import _stored

    weights = np.arange(6, dtype=np.float32).reshape(2, 3)
    for folder in ("model", "copy"):
        (tmp_path / folder).mkdir()
    save_file({"proj.weight": weights}, tmp_path / "model" / "model.safetensors")
    os.link(tmp_path / "model" / "model.safetensors", tmp_path / "copy" / "model.safetensors")
    _, tensor = _stored("wrapper.proj.weight", ["wrapper.proj.weight"], checkpoint_index(tmp_path / "copy"))
    np.testing.assert_array_equal(tensor.numpy(), weights)


def test_fp16_export_keeps_float32_io_and_t5s_wo(lazy_export):
    model, _, counts = lazy_export("text_encoder_3", "float16")
    assert model.graph.inputs[0].dtype == ir.DataType.INT64 and model.graph.outputs[0].dtype == ir.DataType.FLOAT
    dtypes = {name: v.const_value.dtype for name, v in model.graph.initializers.items()}
    assert dtypes["t5.encoder.embed_tokens.weight"] == ir.DataType.FLOAT16
    # transformers keeps T5's feed-forward output projection in float32 (it overflows fp16)
    wo = [n for n in model.graph if n.op_type == "MatMul" and "DenseReluDense.wo'" in n.metadata_props.get("pkg.torch.onnx.name_scopes", "")]
    assert wo and all(n.inputs[1].dtype == ir.DataType.FLOAT for n in wo)
    # sd3-tiny's checkpoint is float32: wo reads it as it is, every other weight is converted
    assert counts["weights_converted"] > 0 and counts["weights_mapped"] == len(wo)
