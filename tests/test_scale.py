"""Real-size models on a small machine: random weights streamed tensor by tensor load through
from_pretrained like a real checkpoint (proven on sd3-tiny's configs), sd3-fullsize has
SD3-medium's true shapes and sd3.5-large-transformer SD3.5-large's transformer."""
from __future__ import annotations

import json
import os

import pytest
import torch

from export.registry import MODELS, SD3_TINY


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    from export.families.sd3 import build_random

    out = tmp_path_factory.mktemp("streamed") / "sd3"
    build_random({**SD3_TINY, "weights_dtype": "float16", "t5_vocab_size": 2000}, out)
    return out


def test_streamed_weights_load_like_a_checkpoint(streamed):
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
    from diffusers.utils import logging

    index = json.loads((streamed / "model_index.json").read_text())
    assert index["text_encoder_3"] == ["transformers", "T5EncoderModel"] and index["_class_name"] == "StableDiffusion3Pipeline"
    header_bytes = (streamed / "text_encoder_3" / "model.safetensors").read_bytes()[:8]
    header = json.loads((streamed / "text_encoder_3" / "model.safetensors").read_bytes()[8:8 + int.from_bytes(header_bytes, "little")])
    assert "encoder.embed_tokens.weight" not in header and header["shared.weight"]["shape"] == [2000, 96]  # tied: once
    logging.set_verbosity_warning()
    pipe = StableDiffusion3Pipeline.from_pretrained(streamed, dtype=torch.float16)
    t5 = pipe.text_encoder_3
    assert t5.shared.weight.dtype == torch.float16 and t5.encoder.embed_tokens.weight is t5.shared.weight
    weight = pipe.transformer.transformer_blocks[0].attn.to_q.weight.float()
    # buffers are the constructor's, not random: the position embedding is SD3's sin-cos table
    built = SD3Transformer2DModel(**SD3_TINY["transformer"]).pos_embed.pos_embed
    assert torch.allclose(pipe.transformer.pos_embed.pos_embed.float(), built, atol=1e-3)
    expected = 0.5 / weight.shape[1] ** 0.5  # INIT_GAIN / sqrt(fan-in)
    assert abs(weight.std().item() - expected) < 0.1 * expected and pipe.transformer.transformer_blocks[0].attn.to_q.bias.abs().max() == 0


def test_sd3_fullsize_has_the_true_sd3_medium_shapes():
    from diffusers import SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    cfg = MODELS["sd3-fullsize"].random_configs
    with torch.device("meta"):
        count = {
            "transformer": SD3Transformer2DModel(**cfg["transformer"]),
            "text_encoder_2": CLIPTextModelWithProjection(CLIPTextConfig(**cfg["text_encoder_2"])),
            "text_encoder_3": T5EncoderModel(T5Config(vocab_size=cfg["t5_vocab_size"], **cfg["text_encoder_3"])),
        }
        count = {name: sum(p.numel() for p in m.parameters()) for name, m in count.items()}
    assert count == {"transformer": 2_028_328_000, "text_encoder_2": 694_659_840, "text_encoder_3": 4_762_310_656}
    assert cfg["weights_dtype"] == "float16" and MODELS["sd3-fullsize"].export_dtype == "float16"


def test_sd35_large_transformer_has_its_true_shape_and_nothing_else_has_weights():
    from diffusers import SD3Transformer2DModel

    cfg = MODELS["sd3.5-large-transformer"].random_configs
    with torch.device("meta"):
        transformer = SD3Transformer2DModel(**cfg["transformer"])
    assert sum(p.numel() for p in transformer.parameters()) == 8_056_627_520
    assert cfg["weights_for"] == ["transformer"]


def test_components_without_weights_are_configs_only(tmp_path):
    from export.families.sd3 import build_random
    from export.registry import ModelEntry
    from export.source import ModelSource

    build_random({**SD3_TINY, "weights_dtype": "float16", "t5_vocab_size": 2000, "weights_for": ["transformer"]},
                 tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["text_encoder"] == [None, None] and index["transformer"][1] == "SD3Transformer2DModel"
    assert not list((tmp_path / "vae").glob("*.safetensors")) and (tmp_path / "vae" / "config.json").exists()
    src = ModelSource(ModelEntry("only-transformer", "sd3"), tmp_path, "x")
    # the transformer's graphs: the denoiser and the First-Block Cache's first block
    assert [s.name for s in src.family.submodules if src.has(s.component)] == ["transformer", "transformer_first_block"]
    assert src.family.constants(src)["clip_width"] == SD3_TINY["text_encoder"]["hidden_size"]  # shapes from configs



def test_drawn_weights_are_the_written_ones(tmp_path):
    """qwen-image-fullsize's weights are drawn by the export as it writes them: a component keeps their recipe
    (kilobytes), and each tensor read from it is the one the written checkpoint holds, bit for bit; nothing can
    load such a component with from_pretrained, and saying so is the error."""
    import numpy as np
    from accelerate import init_empty_weights
    from diffusers import QwenImageTransformer2DModel

    from export.lazy_weights import _stored, checkpoint_index
    from export.random_weights import write_component
    from export.registry import QWEN_IMAGE_TINY, ModelEntry
    from export.source import ModelSource, SourceError
    from runners.manifest import tensor_values

    with init_empty_weights(include_buffers=False):
        module = QwenImageTransformer2DModel(**QWEN_IMAGE_TINY["transformer"])
    written = write_component(module, tmp_path / "written", "float16", seed=3)
    assert write_component(module, tmp_path / "drawn", "float16", seed=3, drawn=True) == 0  # no persistent buffers
    assert sum(f.stat().st_size for f in (tmp_path / "drawn").iterdir()) < 0.1 * written
    ours, theirs = checkpoint_index(tmp_path / "drawn"), checkpoint_index(tmp_path / "written")
    assert {k: (e["dtype"], e["shape"], e["length"]) for k, e in ours.items()} == {
        k: (e["dtype"], e["shape"], e["length"]) for k, e in theirs.items()}
    for key in theirs:
        drawn, stored = (tensor_values(_stored(f"w.{key}", [f"w.{key}"], index)[1]) for index in (ours, theirs))
        assert drawn.dtype == np.float16 and np.array_equal(drawn, stored), key
    with pytest.raises(SourceError, match="drawn's drawn has no weights on disk: the export draws them"):
        ModelSource(ModelEntry("drawn", "qwen_image"), tmp_path, "x").load("drawn")


def test_passes_run_on_a_graph_over_2gb_without_reading_its_weights(tmp_path):
    """The ORT target's passes on a graph whose weights (2.7 GB, a sparse file: nothing on disk)
    are over protobuf's limit: the libraries get the graph without them, so shape inference never
    meets the 2 GB limit, and the weights are not read (the peak RSS stays far below their size)."""
    import numpy as np
    import onnx_ir as ir

    from engines.passes import run_passes
    from export.peak_rss import peak_mib, reset_peak

    rows, cols = 32768, 40960  # fp16: 2.5 GiB
    (tmp_path / "big.onnx.data").touch()
    os.truncate(tmp_path / "big.onnx.data", rows * cols * 2)
    weight = ir.ExternalTensor("big.onnx.data", 0, rows * cols * 2, ir.DataType.FLOAT16, shape=ir.Shape([rows, cols]),
                               name="w", base_dir=tmp_path)
    x = ir.Value(name="x", shape=ir.Shape(["batch", rows]), type=ir.TensorType(ir.DataType.FLOAT16))
    w = ir.Value(name="w", shape=weight.shape, type=ir.TensorType(ir.DataType.FLOAT16), const_value=weight)
    matmul = ir.Node("", "MatMul", [x, w], num_outputs=1)
    relu = ir.Node("", "Relu", [matmul.outputs[0]], num_outputs=1)
    relu.outputs[0].name = "y"
    graph = ir.Graph([x], [relu.outputs[0]], nodes=[matmul, relu], initializers=[w], opset_imports={"": 20})
    model = ir.Model(graph, ir_version=10)
    if not reset_peak():
        pytest.skip("this kernel cannot reset the peak RSS (/proc/self/clear_refs)")
    before = peak_mib()
    # infer_shapes first: fold_constants' polygraphy infers shapes too, and would leave it none to add
    model, reports = run_passes(model, ["infer_shapes", "fold_constants", "remove_dead_nodes"])
    assert peak_mib() - before < 512  # the 2.5 GiB of weights were never read
    assert {r["name"]: r["counts"].get("shapes_added") for r in reports}["infer_shapes"] == 1
    assert model.graph.node(0).outputs[0].shape == ir.Shape(["batch", cols])
    assert isinstance(model.graph.initializers["w"].const_value, ir.ExternalTensor)
    assert np.dtype(model.graph.initializers["w"].const_value.dtype.numpy()) == np.float16


def test_a_graph_with_external_weights_keeps_its_small_constants_inline(tiny_build, tmp_path, monkeypatch):
    """Over 2 GB the weights go to NAME.onnx.data and small constants stay inline (ONNX Runtime
    reads Split's widths, made by fuse_qkv, and shapes at load time): forced here on sd3-tiny by a
    zero limit, the artifact builds, its graph files are kilobytes, and it makes an image."""
    import shutil

    import runners.manifest
    from engines.api import build_artifact
    from runners.pipeline import Pipeline

    monkeypatch.setattr(runners.manifest, "ONNX_INLINE_LIMIT", 0)
    shutil.copytree(tiny_build / "onnx", tmp_path / "onnx")
    artifact = build_artifact(tmp_path, "ort", "fp32")  # its session check opens every graph
    assert (artifact / "transformer.onnx.data").exists()
    image = Pipeline.load(artifact)("a cat", num_inference_steps=2, output_type="np")
    assert image.shape[-1] == 3 and os.path.getsize(artifact / "transformer.onnx") < 2**20


def _weight():
    import numpy as np

    return np.arange(4096, dtype=np.float32).reshape(64, 64)


def _matmul(weight):
    """A graph of one MatMul by the initializer `w`: x (n, 64) -> y."""
    import onnx_ir as ir

    x = ir.Value(name="x", shape=ir.Shape(["n", 64]), type=ir.TensorType(ir.DataType.FLOAT))
    w = ir.Value(name="w", const_value=ir.tensor(weight, name="w"))
    node = ir.node("MatMul", [x, w], num_outputs=1)
    node.outputs[0].name = "y"
    return ir.Model(ir.Graph([x], node.outputs, nodes=[node], initializers=[w], opset_imports={"": 17}), ir_version=8)


def test_linked_weights_stay_in_the_exports_file(tmp_path):
    """`--ort-link-weights` (save_graph's `link`): a graph's weights still read unchanged from another folder's
    external data stay there, that file hard-linked beside the new graph, and only the others are written (here a
    weight a pass made: fuse_qkv's fused projections); ONNX Runtime reads both files. Without it, both are copied."""
    import numpy as np
    import onnx_ir as ir
    import onnxruntime as ort

    from runners.manifest import load_onnx, save_graph

    weight, bias = _weight(), np.ones(64, np.float32)
    (tmp_path / "export").mkdir()
    save_graph(_matmul(weight), tmp_path / "export" / "m.onnx", external={"w"})
    files = {}
    for link in (True, False):
        model = load_onnx(tmp_path / "export" / "m.onnx")
        b = ir.Value(name="b", const_value=ir.tensor(bias, name="b"))
        add = ir.node("Add", [model.graph.outputs[0], b], num_outputs=1)
        model.graph.append(add)
        model.graph.register_initializer(b)
        add.outputs[0].name = "z"
        model.graph.outputs[0] = add.outputs[0]
        (tmp_path / str(link)).mkdir()
        files[link] = save_graph(model, tmp_path / str(link) / "m.onnx", external={"w", "b"}, link=link)
        out = ort.InferenceSession(str(tmp_path / str(link) / "m.onnx")).run(None, {"x": np.eye(64, dtype=np.float32)})
        assert np.array_equal(out[0], weight + bias), link
    assert files == {True: ["m.onnx", "m.onnx.data", "m.onnx.linked.data"], False: ["m.onnx", "m.onnx.data"]}
    linked, exported = tmp_path / "True" / "m.onnx.linked.data", tmp_path / "export" / "m.onnx.data"
    assert linked.stat().st_ino == exported.stat().st_ino
    assert (tmp_path / "True" / "m.onnx.data").stat().st_size == bias.nbytes  # only what the export lacks
    assert (tmp_path / "False" / "m.onnx.data").stat().st_size == weight.nbytes + bias.nbytes


def test_weights_in_a_hard_linked_file_are_read(tmp_path):
    """A LoRA artifact and a Triton repository share the files they leave unchanged by hard links.
    onnx-ir refuses to read a file with two links (`ir.load` alone fails here); the build and the
    memory planner read it through `load_onnx`, the same bytes."""
    import numpy as np
    import onnx_ir as ir

    from engines.memory.graph import load_graph
    from runners.manifest import load_onnx, save_graph

    weight = _weight()
    (tmp_path / "a").mkdir()
    assert save_graph(_matmul(weight), tmp_path / "a" / "m.onnx", external={"w"}) == ["m.onnx", "m.onnx.data"]
    (tmp_path / "b").mkdir()
    os.link(tmp_path / "a" / "m.onnx.data", tmp_path / "b" / "m.onnx.data")
    with pytest.raises(ValueError, match="hard link"):
        ir.load(tmp_path / "a" / "m.onnx").graph.initializers["w"].const_value.numpy()
    assert np.array_equal(load_onnx(tmp_path / "a" / "m.onnx").graph.initializers["w"].const_value.numpy(), weight)
    assert load_graph(tmp_path / "a" / "m.onnx", {"n": 2}).parameters == weight.size
