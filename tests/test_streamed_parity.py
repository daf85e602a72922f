"""The parity check of a submodule too large to hold (export/streamed_parity.py: FLUX.1's 12 B
transformer in `make scale-check SCALE_MODEL=flux-fullsize`), on flux-tiny's transformer with segments
of a few kilobytes: it measures what the whole check measures, and it fails where the graph is wrong; it reads a
checkpoint whose keys transformers renames as it loads (Qwen-Image's text encoder).
And fp16 exports of Flux: their time embedding is fed exact timesteps, so the graph stays within fp16's
activation rounding of the fp32 module; of Qwen-Image's VAE decoder: it denormalises in fp16."""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
import torch

from conftest import manifest
from export.onnx_export import check_parity, example_inputs, export_submodule, wrapped
from export.shapes import dim_ranges, probe_dims
from export.streamed_parity import segmented_outputs, segments

pytestmark = pytest.mark.export


def _setting(src, name: str = "transformer"):
    family = src.family
    constants = family.constants(src)
    spec = next(s for s in family.submodules if s.name == name and s.applies(src))
    return spec, constants, probe_dims(src.entry, family, constants), set(dim_ranges(src.entry, family, constants))


def test_the_streamed_check_measures_what_the_whole_check_measures(flux_tiny_build):
    src, graph = flux_tiny_build.source, flux_tiny_build.folder / "onnx" / "transformer.onnx"
    spec, constants, probes, _ = _setting(src)
    parts = segments(onnx.load(str(graph), load_external_data=False), 20_000)
    assert len(parts) > 20  # the double and single blocks' weights are several segments each
    streamed = check_parity(spec, src, "float32", constants, probes, graph, whole_max_bytes=0, segment_bytes=20_000)
    whole = manifest(flux_tiny_build.folder / "onnx")["submodules"]["transformer"]["export"]["parity"]
    assert all(p.ok for p in streamed)
    for s, w in zip(streamed, whole):  # the same function, computed the same way: measured equal
        assert s.max_abs_ref == pytest.approx(w["max_abs_ref"], rel=1e-6)
        assert s.max_abs_err <= 2 * w["max_abs_err"] + 1e-6, (s, w)


def test_a_containers_own_parameters_are_read_for_the_call(z_image_tiny_build):
    """Z-Image's wrapper reads the transformer's pad tokens without calling the transformer (it calls its
    blocks): the streamed check holds them for the whole call, and measures what the whole check does."""
    src, graph = z_image_tiny_build.source, z_image_tiny_build.folder / "onnx" / "transformer.onnx"
    spec, constants, probes, _ = _setting(src)
    streamed = check_parity(spec, src, "float32", constants, probes, graph, whole_max_bytes=0, segment_bytes=200_000)
    whole = manifest(z_image_tiny_build.folder / "onnx")["submodules"]["transformer"]["export"]["parity"]
    assert all(p.ok for p in streamed)
    for s, w in zip(streamed, whole):
        assert s.max_abs_ref == pytest.approx(w["max_abs_ref"], rel=1e-6)
        assert s.max_abs_err <= 2 * w["max_abs_err"] + 1e-6, (s, w)


def test_weights_are_read_under_the_names_transformers_loads_them_as(qwen_image_tiny_build):
    """Qwen-Image's Qwen2.5-VL checkpoint names its language model `model.*`, which transformers loads as
    `model.language_model.*`: the streamed check (an fp16 export's) reads each weight by its checkpoint key."""
    src, graph = qwen_image_tiny_build.source, qwen_image_tiny_build.folder / "onnx" / "text_encoder.onnx"
    spec, constants, probes, _ = _setting(src, "text_encoder")
    streamed = check_parity(spec, src, "float32", constants, probes, graph, whole_max_bytes=0, segment_bytes=200_000)
    whole = manifest(qwen_image_tiny_build.folder / "onnx")["submodules"]["text_encoder"]["export"]["parity"]
    assert all(p.ok for p in streamed)
    for s, w in zip(streamed, whole):
        assert s.max_abs_ref == pytest.approx(w["max_abs_ref"], rel=1e-6)


def test_the_streamed_check_fails_on_a_wrong_weight(flux_tiny_build, tmp_path):
    """One weight in the middle of the graph (of the MatMuls' in order) negated in a copy of it."""
    src, graph = flux_tiny_build.source, flux_tiny_build.folder / "onnx" / "transformer.onnx"
    spec, constants, probes, _ = _setting(src)
    model = onnx.load(str(graph))
    inits = {i.name: i for i in model.graph.initializer}
    weights = [n.input[1] for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    init = inits[weights[len(weights) // 2]]
    init.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(init) * np.float32(-1), init.name))
    onnx.save(model, str(tmp_path / "transformer.onnx"))
    streamed = check_parity(spec, src, "float32", constants, probes, tmp_path / "transformer.onnx",
                            whole_max_bytes=0, segment_bytes=20_000)
    assert not any(p.ok for p in streamed), streamed
    assert not list(tmp_path.glob(".*segment*"))  # each segment's model is gone once its session opened


def test_segments_keep_what_later_segments_read(flux_tiny_build):
    """The outputs of the segmented run equal a whole session's exactly at every segment size."""
    import onnxruntime as ort

    src, graph = flux_tiny_build.source, flux_tiny_build.folder / "onnx" / "transformer.onnx"
    spec, constants, probes, _ = _setting(src)
    feeds = [{t.name: a for t, a in zip(spec.inputs, example_inputs(spec, probes[1], constants, seed=1))}]
    whole = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"]).run(None, feeds[0])
    for size in (1, 50_000, 1 << 30):  # a node per segment, some, one segment
        got = segmented_outputs(graph, feeds, ort.SessionOptions(), size)[0]
        np.testing.assert_allclose(got[0], whole[0], rtol=0, atol=1e-5)


def test_a_flux_fp16_export_feeds_its_time_embedding_exact_timesteps(flux_tiny_build, tmp_path):
    """diffusers' transformer casts the timestep and guidance to its dtype before multiplying them by
    1000: in fp16 their sinusoids' phases turn by up to a quarter radian. The fp16 export takes them in
    fp32 and keeps the time embedding in fp32 (its spec's fp32_inputs and fp32_scopes): its graph is
    within fp16's activation rounding of the fp32 module, where diffusers' own fp16 module is not."""
    import onnxruntime as ort

    src = flux_tiny_build.source
    spec, constants, probes, dynamic = _setting(src)
    report = export_submodule(spec, src, "float16", constants, dynamic, probes, tmp_path / "transformer.onnx")
    # measured 7.7e-4 and 8.3e-4 of the reference's scale
    assert all(p["max_abs_err"] <= 1.5e-3 * max(1.0, p["max_abs_ref"]) for p in report["parity"]), report["parity"]
    inputs = example_inputs(spec, probes[0], constants, seed=100)
    session = ort.InferenceSession(str(tmp_path / "transformer.onnx"), providers=["CPUExecutionProvider"])
    ours = session.run(None, {t.name: a for t, a in zip(spec.inputs, inputs)})[0]
    rounded = dataclasses.replace(spec, quantization={k: v for k, v in spec.quantization.items()
                                                      if k not in ("fp32_inputs", "fp32_scopes")})
    with torch.no_grad():
        fp32 = wrapped(spec, src.load("transformer").eval())(*map(torch.from_numpy, inputs))[0].numpy()
        fp16 = wrapped(rounded, src.load("transformer", torch_dtype=torch.float16).eval(), "float16")(
            *map(torch.from_numpy, inputs))[0].numpy()
    scale = np.abs(fp32).max()
    assert np.abs(ours - fp32).max() <= 1e-3 * scale  # measured 4.7e-4
    assert np.abs(fp16 - fp32).max() >= 5e-3 * scale  # measured 1.2e-2: what the exact timesteps avoid


def test_a_qwen_image_fp16_decoder_takes_its_statistics_in_fp16(qwen_image_tiny_build, tmp_path):
    """Qwen-Image's VAE decoder denormalises the latents by the config's statistics: made in the latents' dtype, as
    diffusers makes them, an fp16 export's convolutions get fp16 (fp32 statistics promoted them: its trace failed)."""
    src = qwen_image_tiny_build.source
    spec, constants, probes, dynamic = _setting(src, "vae_decoder")
    report = export_submodule(spec, src, "float16", constants, dynamic, probes, tmp_path / "vae_decoder.onnx")
    # measured 1.4e-3 of the reference's scale, at the exporter's own fp16 bound (PARITY_RTOL)
    assert all(p["max_abs_err"] <= 2e-2 * max(1.0, p["max_abs_ref"]) for p in report["parity"]), report["parity"]
