"""Export: every SD3 submodule matches PyTorch in ONNX Runtime, at the two shapes the exporter
checked and at a third one chosen here; axes carry our names; failures leave nothing behind."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from export.families import FAMILIES
from export.onnx_export import PARITY_RTOL, example_inputs
from conftest import manifest

SD3 = FAMILIES["sd3"]
SUBMODULES = [s.name for s in SD3.submodules]
# A third setting of the dims, unlike both export probes: batch 3, a wide image with odd patch
# counts (5 x 7: an exporter once cropped SD3's position embedding wrong there), 40 T5 tokens.
THIRD = {"batch": 3, "latent_height": 10, "latent_width": 14, "text_length": 40,
         "image_height": 80, "image_width": 112, "joint_length": 117, "image_tokens": 35}  # 5 x 7 patches


def test_every_submodule_is_exported_and_checked_at_two_shapes(tiny_build):
    subs = manifest(tiny_build / "onnx")["submodules"]
    assert sorted(subs) == sorted(SUBMODULES)
    for name, sub in subs.items():
        parity = sub["export"]["parity"]
        assert len(parity) == 2 and parity[0]["dims"] != parity[1]["dims"], name
        for p in parity:
            assert p["max_abs_err"] <= PARITY_RTOL["float32"] * max(1.0, p["max_abs_ref"]), (name, p)
        assert sub["export"]["bytes"] == (tiny_build / "onnx" / sub["file"]).stat().st_size
        assert sub["export"]["peak_rss_mib"] > 0, name  # measured per submodule


@pytest.mark.parametrize("name", SUBMODULES)
def test_graph_matches_pytorch_at_a_third_shape(tiny_build, tiny_source, name):
    spec = next(s for s in SD3.submodules if s.name == name)
    constants = manifest(tiny_build / "onnx")["constants"]
    module = spec.wrap(tiny_source.load(spec.component, **spec.load_kwargs).eval()).eval()
    inputs = example_inputs(spec, THIRD, constants, seed=7)
    with torch.no_grad():
        ref = [r.numpy() for r in module(*map(torch.from_numpy, inputs))]
    session = ort.InferenceSession(str(tiny_build / "onnx" / f"{name}.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {t.name: a for t, a in zip(spec.inputs, inputs)})
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        assert np.abs(g - r).max() <= PARITY_RTOL["float32"] * max(1.0, np.abs(r).max())


def test_dynamic_axes_carry_our_dimension_names(tiny_build):
    model = onnx.load(str(tiny_build / "onnx" / "transformer.onnx"), load_external_data=False)
    shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in list(model.graph.input) + list(model.graph.output)}
    assert shapes["hidden_states"] == ["batch", 16, "latent_height", "latent_width"]
    assert shapes["encoder_hidden_states"] == ["batch", "joint_length", 96]
    assert shapes["noise_pred"] == ["batch", 16, "latent_height", "latent_width"]
    t5 = onnx.load(str(tiny_build / "onnx" / "text_encoder_3.onnx"), load_external_data=False)
    assert [d.dim_param for d in t5.graph.input[0].type.tensor_type.shape.dim] == ["batch", "text_length"]


def test_reexport_with_same_inputs_is_reused(tiny_build, tiny_source, capsys):
    from export.api import export_model

    before = (tiny_build / "onnx" / "manifest.json").stat().st_mtime_ns
    export_model(tiny_source, tiny_build)
    assert "up to date" in capsys.readouterr().out
    assert (tiny_build / "onnx" / "manifest.json").stat().st_mtime_ns == before


@pytest.mark.parametrize("error", [RuntimeError("injected"), KeyboardInterrupt()])
def test_failure_midway_leaves_no_onnx_folder(tmp_path, tiny_source, monkeypatch, error):
    import export.api

    real, calls = export.api.export_submodule, []

    def failing(spec, *args, **kwargs):
        calls.append(spec.name)
        if len(calls) == 3:
            raise error
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(export.api, "export_submodule", failing)
    with pytest.raises(type(error)):
        export.api.export_model(tiny_source, tmp_path)
    assert len(calls) == 3
    assert list(tmp_path.iterdir()) == []  # neither onnx/ nor a temporary folder


def test_a_files_content_id_is_its_hub_blob_name_or_its_sha256(tmp_path):
    """A Hugging Face cache names its blobs by their content: a component's digest reads no weights there."""
    from export.source import _content_id
    from runners.manifest import sha256_file

    blob = tmp_path / "blobs" / "3f0a9c"
    blob.parent.mkdir()
    blob.write_bytes(b"weights")
    linked, plain = tmp_path / "snapshot" / "model.safetensors", tmp_path / "plain.safetensors"
    linked.parent.mkdir()
    linked.symlink_to(blob)
    plain.write_bytes(b"weights")
    assert _content_id(linked) == "3f0a9c"
    assert _content_id(plain) == sha256_file(plain)


def test_a_components_digest_is_its_content_not_where_it_was_saved(tiny_source, tmp_path):
    """save_pretrained writes where a module came from into its config (`_name_or_path`): a component
    saved again elsewhere keeps its digest, and links its graphs; a changed setting does not."""
    import json
    import shutil

    from export.source import resolve

    copy = tmp_path / "copy"
    shutil.copytree(tiny_source.folder, copy)
    config_path = copy / "vae" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "_name_or_path": str(tiny_source.folder / "vae")}))
    assert resolve(str(copy)).component_digest("vae") == tiny_source.component_digest("vae")
    config_path.write_text(json.dumps({**config, "scaling_factor": 1.0}))
    assert resolve(str(copy)).component_digest("vae") != tiny_source.component_digest("vae")


def test_a_graphs_key_holds_only_the_shapes_it_names(tiny_source):
    """Another image size range changes the keys of the graphs that take images, not the text encoders':
    an export for new sizes links those, and FLUX.1 Fill's takes FLUX.1 dev's whatever their sizes."""
    import dataclasses

    from export.api import EXPORT_FORMAT, _submodule_key
    from export.shapes import dim_ranges, probe_dims

    constants = SD3.constants(tiny_source)

    def keys(image_size):
        entry = dataclasses.replace(tiny_source.entry, image_size=image_size)
        ranges, probes = dim_ranges(entry, SD3, constants), probe_dims(entry, SD3, constants)
        return {s.name: _submodule_key(s, tiny_source, [EXPORT_FORMAT], ranges, probes, constants)
                for s in SD3.submodules if s.applies(tiny_source)}

    small, large = keys((64, 128, 256)), keys((64, 256, 512))
    assert {name for name in small if small[name] == large[name]} == {"text_encoder", "text_encoder_2",
                                                                       "text_encoder_3"}
