"""LoRA without re-export: weight provenance, the offline `lora` command, and switching adapters at
run time, each against diffusers' own `load_lora_weights` + `fuse_lora` on the same weights, fp32,
same latents: images within 1/255 (measured: about 1e-5)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from bench.accuracy import psnr as _psnr
from conftest import assert_real_image, manifest
from engines.lora import apply_loras
from lora_adapters import ATTENTION, CLIP_ATTENTION, make_adapter, to_kohya, with_peft_naming
from runners import Pipeline
from runners.adapters.lora import LoraError, artifact_weights, submodule_tables
from runners.adapters.quantized import INT8_CODES

ONE_LEVEL = 1 / 255
CALL = dict(prompt="a photo of a cat", height=64, width=64, num_inference_steps=4, output_type="np")


def _latents(channels: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, channels, 8, 8), dtype=np.float32)


def _reference(pipeline_cls, folder, adapters: dict, latents, **kwargs) -> np.ndarray:
    """diffusers' image with `adapters` ({file: scale}) loaded and fused (none: the base model)."""
    pipe = pipeline_cls.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    names = [f"a{i}" for i in range(len(adapters))]
    for name, path in zip(names, adapters):
        pipe.load_lora_weights(path, adapter_name=name)
    if adapters:
        pipe.set_adapters(names, list(adapters.values()))
        pipe.fuse_lora(adapter_names=names)
    return pipe(latents=torch.from_numpy(latents), **{**CALL, **kwargs}).images


# --- sd3-tiny ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sd3_lora_artifact(tiny_artifact, sd3_adapters, tmp_path_factory):
    return apply_loras(tiny_artifact, {sd3_adapters["a"]: 0.8}, tmp_path_factory.mktemp("sd3-a") / "art")


def test_provenance_rebuilds_every_weight_from_the_checkpoint(tiny_source, tiny_artifact):
    """Every recorded part (slice, transpose) of every weight in the artifact's external data equals
    the checkpoint tensor it names: fuse_qkv's concatenations and the exporter's transposes included."""
    from safetensors.numpy import load_file

    data = manifest(tiny_artifact)
    checkpoint = {c: {k: v for f in (tiny_source.folder / c).glob("*.safetensors") for k, v in load_file(f).items()}
                  for c in ("text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae")}
    base = artifact_weights(tiny_artifact)
    checked, fused = 0, 0
    tracked = set()
    for sub, table in submodule_tables(tiny_artifact, data).items():
        for name, record in table.items():
            tracked |= {(p["component"], p["key"]) for p in record["parts"]}
            if "location" not in record:  # under 1 KiB: kept inside the graph (biases, norms of the tiny model)
                continue
            expected = np.zeros(record["shape"], np.float32)
            for part in record["parts"]:
                value = checkpoint[part["component"]][part["key"]]
                value = np.transpose(value, part["perm"]) if part.get("perm") else value
                expected[(slice(None),) * part["axis"] + (slice(part["start"], part["stop"]),)
                         if "axis" in part else ()] = value
            np.testing.assert_array_equal(base(name, record), expected, err_msg=f"{sub}: {name}")
            checked += 1
            fused += any("axis" in p for p in record["parts"])
    assert checked >= 90 and fused >= 10
    # Every 2-D weight of the checkpoints is tracked, but the position embeddings the exporter folds
    # (CLIP's, read at constant positions) and the VAE encoder's half that no engine of ours runs.
    weights = {(c, k) for c, tensors in checkpoint.items() for k, v in tensors.items() if v.ndim >= 2}
    untracked = {k for c, k in weights - tracked}
    assert untracked == {"text_model.embeddings.position_embedding.weight", "pos_embed.pos_embed"} | {
        k for k in untracked if k.startswith(("encoder.quant_conv", "decoder.post_quant"))}


def test_pass_reports_count_the_tracked_weights(tiny_artifact):
    submodules = manifest(tiny_artifact)["submodules"]
    assert all(r["weights_tracked"] > 0 and r["parameters_lost"] == 0 for s in submodules.values() for r in s["passes"])
    reports = submodules["transformer"]["passes"]
    fuse = next(r for r in reports if r["name"] == "fuse_qkv")
    before = reports[[r["name"] for r in reports].index("fuse_qkv") - 1]["weights_tracked"]
    # each group's weights (and biases) became one fused weight (and bias) with their slices recorded
    assert fuse["weights_tracked"] < before


def test_offline_and_runtime_match_diffusers(tiny_source, tiny_artifact, sd3_lora_artifact, sd3_adapters):
    from diffusers import StableDiffusion3Pipeline

    latents = _latents(16)
    kwargs = dict(max_sequence_length=32)
    ref = _reference(StableDiffusion3Pipeline, tiny_source.folder, {sd3_adapters["a"]: 0.8}, latents, **kwargs)
    base = _reference(StableDiffusion3Pipeline, tiny_source.folder, {}, latents, **kwargs)
    assert np.abs(ref - base).max() > 0.1  # the adapter changes the image
    assert_real_image(ref)
    offline = Pipeline.load(sd3_lora_artifact)(latents=latents, **CALL, **kwargs)
    runtime = Pipeline.load(tiny_artifact, loras={sd3_adapters["a"]: 0.8})(latents=latents, **CALL, **kwargs)
    assert np.abs(offline - ref).max() <= ONE_LEVEL
    assert np.array_equal(offline, runtime)


def test_two_adapters_at_once_match_diffusers(tiny_source, tiny_artifact, sd3_adapters):
    from diffusers import StableDiffusion3Pipeline

    adapters = {sd3_adapters["a"]: 0.5, sd3_adapters["b"]: 1.2}
    latents = _latents(16, seed=1)
    ref = _reference(StableDiffusion3Pipeline, tiny_source.folder, adapters, latents, max_sequence_length=32)
    ours = Pipeline.load(tiny_artifact, loras=adapters)(latents=latents, **CALL, max_sequence_length=32)
    assert np.abs(ours - ref).max() <= ONE_LEVEL


def test_switching_a_b_a_none_gives_each_exactly(tiny_artifact, sd3_adapters, tmp_path):
    """TensorRT #3628's failure (A -> B -> A blends A and B) cannot happen: every switch starts from
    the artifact's own weights. Each image equals the offline-applied artifact's."""
    a, b = sd3_adapters["a"], sd3_adapters["b"]
    latents = _latents(16, seed=2)
    offline = {key: Pipeline.load(apply_loras(tiny_artifact, loras, tmp_path / key))(latents=latents, **CALL)
               for key, loras in (("a", {a: 1.0}), ("b", {b: 1.0}))}
    pipe = Pipeline.load(tiny_artifact)
    base = pipe(latents=latents, **CALL)
    seen = []
    for key, loras in (("a", {a: 1.0}), ("b", {b: 1.0}), ("a", {a: 1.0}), ("none", {})):
        pipe.set_loras(loras)
        seen.append(pipe(latents=latents, **CALL))
        assert np.array_equal(seen[-1], offline.get(key, base)), key
    assert not np.array_equal(seen[0], seen[1])


def test_scale_zero_is_the_base_artifact_exactly(tiny_artifact, sd3_adapters):
    latents = _latents(16, seed=3)
    base = Pipeline.load(tiny_artifact)(latents=latents, **CALL)
    assert np.array_equal(Pipeline.load(tiny_artifact, loras={sd3_adapters["b"]: 0.0})(latents=latents, **CALL), base)


def test_a_lora_on_a_fused_projection_changes_exactly_its_slice(tiny_artifact, sd3_adapters, tmp_path):
    """to_k alone: the fused q/k/v weight of each attention changes in k's columns only."""
    from lora_adapters import read_raw, write_raw

    tensors, metadata = read_raw(sd3_adapters["a"])
    only_k = write_raw(tmp_path / "k.safetensors", {k: v for k, v in tensors.items()
                                                     if k.startswith("transformer.") and ".to_k." in k}, metadata)
    data = manifest(tiny_artifact)
    table = submodule_tables(tiny_artifact, data)["transformer"]
    from runners.adapters.lora import adapted_submodules

    changed = adapted_submodules(tiny_artifact, data, {only_k: 1.0})["transformer"]
    base = artifact_weights(tiny_artifact)
    assert changed
    for name, value in changed.items():
        record = table[name]
        k = next(p for p in record["parts"] if p["key"].endswith("attn.to_k.weight"))
        diff = np.abs(value - base(name, record)).max(axis=0)  # per output column of the (in, out) weight
        inside = np.zeros(diff.shape, bool)
        inside[k["start"]:k["stop"]] = True
        assert len(record["parts"]) >= 3 and k["axis"] == 1
        assert diff[inside].min() > 0 and diff[~inside].max() == 0, name


def test_offline_artifact_shares_unchanged_files_and_records_the_adapters(tiny_artifact, sd3_lora_artifact,
                                                                          sd3_adapters):
    """Only the touched engines' graphs and weight tables are rewritten, and their adapted weights go
    to a file of their own; every other file (the large weight files too) is the source's, linked."""
    from runners.manifest import sha256_file

    data, source = manifest(sd3_lora_artifact), manifest(tiny_artifact)
    assert data["loras"] == [{"file": sd3_adapters["a"].name, "sha256": sha256_file(sd3_adapters["a"]), "scale": 0.8}]
    new = set(data["files"]) - set(source["files"])
    touched = ("transformer", "transformer_first_block", "text_encoder")  # the first-block graph holds block 0's
    assert {f.split(".lora-")[0] for f in new} == set(touched) and all(f.endswith(".data") for f in new)
    written = {f"{s}.{kind}" for s in touched for kind in ("onnx", "weights.json")}
    for f in source["files"]:
        same_inode = os.stat(sd3_lora_artifact / f).st_ino == os.stat(tiny_artifact / f).st_ino
        assert same_inode == (f not in written), f
    new_bytes = sum((sd3_lora_artifact / f).stat().st_size for f in new)
    assert new_bytes < (tiny_artifact / "transformer.onnx.data").stat().st_size / 2  # the touched weights only
    Pipeline.load(sd3_lora_artifact)  # its manifest's checksums hold (the linked files' are the source's)


def _runner_cli_gives_the_offline_image(artifact, lora: str, offline, image) -> list[str]:
    """The runner's `--lora` applies the adapter for one run (2 steps, 64x64, seed 0): the offline-applied
    artifact's image exactly. Returns the command line without --lora and --out."""
    from PIL import Image

    run = [sys.executable, "-m", "runners", str(artifact), "--prompt", "a cat", "--steps", "2", "--height", "64",
           "--width", "64"]
    done = subprocess.run(run + ["--lora", lora, "--out", str(image)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    expected = Pipeline.load(offline)("a cat", num_inference_steps=2, height=64, width=64, seed=0, output_type="np")[0]
    assert np.array_equal(np.asarray(Image.open(image)), (expected * 255).round().astype(np.uint8))
    return run


def test_lora_command_lines(tiny_artifact, sd3_adapters, tmp_path):
    out = tmp_path / "cli"
    done = subprocess.run([sys.executable, "-m", "engines", "lora", str(tiny_artifact), "--lora",
                           f"{sd3_adapters['b']}:0.5", "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert manifest(out)["loras"][0]["scale"] == 0.5 and "weights adapted" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "engines", "lora", str(tiny_artifact), "--lora",
                          str(tmp_path / "missing.safetensors"), "--out", str(tmp_path / "x")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "missing.safetensors does not exist" in bad.stderr
    assert not (tmp_path / "x").exists()
    run = _runner_cli_gives_the_offline_image(tiny_artifact, f"{sd3_adapters['b']}:0.5", out, tmp_path / "lora.png")
    bad = subprocess.run(run + ["--lora", f"{tmp_path / 'missing.safetensors'}:0.5", "--out", str(tmp_path / "no.png")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "missing.safetensors does not exist" in bad.stderr
    assert not (tmp_path / "no.png").exists()


def test_keys_that_match_nothing_are_an_error_listing_them(tiny_artifact, sd3_adapters, tmp_path):
    from lora_adapters import read_raw, write_raw

    tensors, metadata = read_raw(sd3_adapters["a"])
    tensors["transformer.no_such_block.to_q.lora_A.weight"] = tensors[next(iter(tensors))]
    odd = write_raw(tmp_path / "odd.safetensors", tensors, metadata)
    with pytest.raises(LoraError, match=r"1 keys match no weight.*no_such_block"):
        Pipeline.load(tiny_artifact, loras={odd: 1.0})
    with pytest.warns(UserWarning, match="skipped 1 keys"):
        Pipeline.load(tiny_artifact, submodules=["transformer"]).set_loras({odd: 1.0}, ignore_unmatched=True)


@pytest.fixture(scope="module")
def precision_artifacts(tiny_build):
    """test_precision.py's fp16, int8 and fp8 artifacts of the same build (built once, cached)."""
    from engines.api import build_artifact

    return {p: build_artifact(tiny_build, "ort", p) for p in ("fp16", "int8", "fp8")}


def test_fp16_artifact_applies_in_float32_and_rounds_once(tiny_artifact, precision_artifacts, sd3_adapters):
    """The fp16 artifact with the adapter against the fp32 one with it, at the error fp16 has
    without one: measured 61.2 dB (the two artifacts without an adapter: 60.7 dB at these latents);
    the bound sits 5 dB below. Each adapted weight is the fp16 weight plus the change in float32,
    rounded once."""
    from runners.adapters.lora import adapted_submodules, weight_deltas

    fp16 = precision_artifacts["fp16"]
    adapters = {sd3_adapters["a"]: 0.8}
    latents = _latents(16, seed=5)
    ref = Pipeline.load(tiny_artifact, loras=adapters)(latents=latents, **CALL)
    got = Pipeline.load(fp16, loras=adapters)(latents=latents, **CALL)
    psnr = float(10 * np.log10(1 / np.mean((ref.astype(np.float64) - got) ** 2)))
    print(f"fp16 with an adapter against fp32 with it: PSNR {psnr:.1f} dB")
    assert psnr >= 56.0
    data = manifest(fp16)
    table = submodule_tables(fp16, data)["transformer"]
    changed = adapted_submodules(fp16, data, adapters)["transformer"]
    deltas = weight_deltas(adapters, table.parameters(), ignore_unmatched=True)
    name = next(n for n, r in table.items() if len(r["parts"]) == 1 and (r["parts"][0]["component"],
                                                                         r["parts"][0]["key"]) in deltas)
    record = table[name]
    part = record["parts"][0]
    change = np.transpose(deltas[(part["component"], part["key"])], part.get("perm") or None)
    expected = (artifact_weights(fp16)(name, record).astype(np.float32) + change).astype(np.float16)
    assert changed[name].dtype == np.float16 and np.array_equal(changed[name], expected)


# The quantized artifacts with adapter A against the fp32 one with it, at CALL; each precision at ADAPTER_SCALE.
# Measured on a Zen 3: int8 (7-bit weights, docs/precision.md) 45.9 dB with the adapter changing the image to
# 20.4 dB; fp8 37.1 dB with a change to 24.4 dB (at 0.8: 29.2 and 21.0: fp8's activation scales were calibrated
# without the adapter, whose activations a strong adapter moves out of them; docs/lora.md). Bounds 5 dB under
# what is measured; the adapter's change lies at least CHANGE_MARGIN dB below the error.
ADAPTER_SCALE = {"int8": 0.8, "fp8": 0.4}
QUANTIZED_MIN_PSNR = {"int8": 40.0, "fp8": 32.5}
CHANGE_MARGIN = {"int8": 10.0, "fp8": 10.0}


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_quantized_artifacts_take_adapters_quantized_again(tiny_artifact, precision_artifacts, sd3_adapters,
                                                           precision, tmp_path):
    """Each weight an adapter changes is dequantized, changed and quantized again by the quantizer's own
    rule, its scales computed afresh (runners/adapters/quantized.py): the image against the fp32 artifact's with
    the adapter, the adapter's change far above the precision's own error, and the same image offline."""
    import onnx_ir as ir

    from runners.adapters.lora import adapted_submodules

    artifact = precision_artifacts[precision]
    data = manifest(artifact)
    table = submodule_tables(artifact, data)["transformer"]
    quantized = {n: r for n, r in table.items() if r.get("quantized")}
    initializers = ir.load(artifact / "transformer.onnx").graph.initializers
    assert quantized and all(table[r["quantized"]["scale"]]["scale_of"] == n for n, r in quantized.items())
    adapters = {sd3_adapters["a"]: ADAPTER_SCALE[precision]}
    changed = adapted_submodules(artifact, data, adapters)["transformer"]
    requantized = [n for n in changed if n in quantized]
    assert requantized and all(quantized[n]["quantized"]["scale"] in changed for n in requantized)
    assert all(changed[n].dtype.itemsize == 1 and changed[n].shape == tuple(initializers[n].shape)
               for n in requantized)
    if precision == "int8":  # quantized again on the artifact's 7-bit codes (runners/adapters/quantized.py)
        assert {r["quantized"]["codes"] for r in quantized.values()} == {INT8_CODES}
        assert all(np.abs(changed[n].astype(np.int16)).max() == INT8_CODES for n in requantized)
    latents = _latents(16, seed=5)
    ref = Pipeline.load(tiny_artifact, loras=adapters)(latents=latents, **CALL)
    base = Pipeline.load(artifact)(latents=latents, **CALL)
    got = Pipeline.load(artifact, loras=adapters)(latents=latents, **CALL)
    offline = Pipeline.load(apply_loras(artifact, adapters, tmp_path / "adapted"))(latents=latents, **CALL)
    psnr, change = _psnr(ref, got), _psnr(base, got)
    print(f"{precision} with an adapter against fp32 with it: PSNR {psnr:.1f} dB; the adapter's change {change:.1f} dB")
    assert psnr >= QUANTIZED_MIN_PSNR[precision], psnr
    assert change < psnr - CHANGE_MARGIN[precision], (change, psnr)
    # fp8's run-time session folds less (runners/backends/ort.py): measured below 1e-5 on AMD Zen 3, 4.6e-5
    # on an AVX-512 Xeon (its kernels round the unfolded DequantizeLinear's products otherwise)
    assert np.abs(offline - got).max() <= 1e-4


def test_parameters_the_exporter_merged_cannot_be_changed_alone():
    """Two equal parameters sharing one initializer (the exporter's deduplication): an adapter on one
    of them is refused, not applied to both."""
    from runners.adapters.lora import adapted
    from runners.adapters.provenance import WeightTable

    table = WeightTable({"bias": {"dtype": "float32", "shape": [4], "parts": [
        {"component": "transformer", "key": "a.weight"}, {"component": "transformer", "key": "b.weight"}]}})
    with pytest.raises(LoraError, match="holds a.weight, b.weight, which were equal"):
        adapted(table, {("transformer", "a.weight"): np.ones(4, np.float32)}, lambda name, record: np.zeros(4))


def _peft_adapter(path, seed: int, out: int = 24, inputs: int = 20, rank: int = 3):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    save_file({"transformer.blocks.0.to_q.lora_A.weight": rng.standard_normal((rank, inputs), dtype=np.float32),
               "transformer.blocks.0.to_q.lora_B.weight": rng.standard_normal((out, rank), dtype=np.float32)}, path)
    return str(path)


def test_a_layers_change_is_the_exactly_rounded_product(tmp_path):
    """Layer.delta is the float32 rounding of the exact scale * alpha / rank * up @ down (math.fsum per
    element), not a BLAS kernel's float32 sum, whose rounding differs between numpy builds and CPUs (the
    Triton stub's numpy 1 and numpy 2 here gave images a level of 255 apart on an AMX Xeon)."""
    import math

    from runners.adapters.lora import read_adapter

    parameters = {("transformer", "blocks.0.to_q.weight")}
    (layer,) = read_adapter(_peft_adapter(tmp_path / "a.safetensors", seed=0), parameters)
    factor = 0.7 * layer.alpha / layer.down.shape[0]
    exact = np.array([[math.fsum(factor * float(u) * float(d) for u, d in zip(row, column))
                       for column in layer.down.T] for row in layer.up], dtype=np.float32)
    assert np.array_equal(layer.delta(0.7), exact)


def test_adapters_merge_in_one_order_whatever_order_they_are_named_in(tmp_path):
    """Three adapters on one weight: their float32 sum depends on its order (checked), and weight_deltas
    gives the same bits for every order of the set, and for a path named another way (relative vs
    resolved), as a server and Pipeline.load(loras=...) name them."""
    import itertools

    from runners.adapters.lora import read_adapter, weight_deltas

    parameters = {("transformer", "blocks.0.to_q.weight")}
    paths = [_peft_adapter(tmp_path / f"{n}.safetensors", seed=i, out=64, inputs=64) for i, n in enumerate("abc")]
    scales = dict(zip(paths, (0.5, 1.0, -0.8)))
    changes = [read_adapter(p, parameters)[0].delta(s) for p, s in scales.items()]
    assert not np.array_equal((changes[0] + changes[1]) + changes[2], (changes[2] + changes[1]) + changes[0])
    merged = [weight_deltas(dict(order), parameters)[("transformer", "blocks.0.to_q.weight")]
              for order in itertools.permutations(scales.items())]
    assert all(np.array_equal(m, merged[0]) for m in merged)
    relative = {os.path.relpath(p): s for p, s in scales.items()}
    assert np.array_equal(weight_deltas(relative, parameters)[("transformer", "blocks.0.to_q.weight")], merged[0])


# --- the U-Net families: kohya's format and PEFT's naming -----------------------------------------


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_unet_families_every_format_matches_diffusers(family, request, tmp_path):
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    build = request.getfixturevalue(f"{family}_tiny_build")
    cls = StableDiffusionPipeline if family == "sd15" else StableDiffusionXLPipeline
    encoders = {"text_encoder": CLIP_ATTENTION, **({"text_encoder_2": ["q_proj", "v_proj"]} if family == "sdxl" else {})}
    peft = make_adapter(cls, build.source.folder, tmp_path / "peft", {"unet": ATTENTION + ["proj_in"], **encoders},
                        seed=3, rank=2, alpha=4.0)
    prefixes = {"unet": "lora_unet_", "text_encoder": "lora_te_" if family == "sd15" else "lora_te1_",
                "text_encoder_2": "lora_te2_"}
    kohya = to_kohya(peft, tmp_path / "kohya.safetensors", prefixes)
    renamed = with_peft_naming(peft, tmp_path / "base_layer.safetensors")
    latents = _latents(4, seed=4)
    ref = _reference(cls, build.source.folder, {peft: 0.9}, latents)
    assert np.abs(ref - _reference(cls, build.source.folder, {}, latents)).max() > 0.05
    if family == "sd15":  # diffusers' own kohya conversion agrees (for SDXL, 0.42 fails on the text encoders' keys
        # "Could not automatically infer state dict type"): the kohya file holds the PEFT file's adapter
        assert np.abs(_reference(cls, build.source.folder, {kohya: 0.9}, latents) - ref).max() <= ONE_LEVEL
    pipe = Pipeline.load(build.folder / "ort-fp32")
    for adapter in (peft, kohya, renamed):
        pipe.set_loras({adapter: 0.9})
        assert np.abs(pipe(latents=latents, **CALL) - ref).max() <= ONE_LEVEL, adapter.name


# --- flux-tiny: diffusers/PEFT (transformer and CLIP), kohya's Flux format, ComfyUI's BFL names ----


FLUX_CALL = dict(CALL, max_sequence_length=16)


def _flux_latents(seed: int) -> np.ndarray:  # packed, as FluxPipeline takes them: (N, 64x64's 16 tokens, 64)
    return np.random.default_rng(seed).standard_normal((1, 16, 64), dtype=np.float32)


@pytest.mark.parametrize("adapter", ["a", "b", "kohya", "comfy"])
def test_flux_formats_match_diffusers(flux_tiny_build, flux_adapters, adapter):
    from diffusers import FluxPipeline

    latents = _flux_latents(seed=len(adapter))
    ref = _reference(FluxPipeline, flux_tiny_build.source.folder, {flux_adapters[adapter]: 0.8}, latents,
                     max_sequence_length=16)
    base = _reference(FluxPipeline, flux_tiny_build.source.folder, {}, latents, max_sequence_length=16)
    assert np.abs(ref - base).max() > 0.05  # the adapter changes the image
    assert_real_image(ref)
    ours = Pipeline.load(flux_tiny_build.folder / "ort-fp32", loras={flux_adapters[adapter]: 0.8})
    got = ours(latents=latents, **FLUX_CALL)
    print(f"flux {adapter}: max abs error {np.abs(got - ref).max():.1e}")
    assert np.abs(got - ref).max() <= ONE_LEVEL


def test_flux_original_names_diffusers_does_not_apply(flux_tiny_build, tmp_path):
    """A single block's fused linear1 and the top-level modules in kohya's Flux format, against diffusers
    reading the same change in its own names (its kohya conversion reads neither: lora_adapters.py)."""
    from diffusers import FluxPipeline

    from lora_adapters import FLUX_ORIGINAL_UNREAD, flux_original_adapter, to_diffusers_split

    src = flux_tiny_build.source.folder
    kohya = flux_original_adapter(src, FLUX_ORIGINAL_UNREAD, tmp_path / "kohya.safetensors", seed=4, alpha=8.0)
    split = to_diffusers_split(kohya, FLUX_ORIGINAL_UNREAD, src, tmp_path / "split.safetensors")
    latents = _flux_latents(seed=4)
    ref = _reference(FluxPipeline, src, {split: 1.0}, latents, max_sequence_length=16)
    assert np.abs(ref - _reference(FluxPipeline, src, {}, latents, max_sequence_length=16)).max() > 0.05
    got = Pipeline.load(flux_tiny_build.folder / "ort-fp32", loras={kohya: 1.0})(latents=latents, **FLUX_CALL)
    print(f"flux linear1 and top-level: max abs error {np.abs(got - ref).max():.1e}")
    assert np.abs(got - ref).max() <= ONE_LEVEL


def test_flux_offline_runtime_and_a_b_a_switching(flux_tiny_build, flux_adapters, tmp_path):
    """`python -m engines lora`'s artifact equals the runtime adapter exactly (and the runner's --lora), and
    switching A -> B -> A -> none gives each exactly (every switch starts from the artifact's own weights)."""
    artifact = flux_tiny_build.folder / "ort-fp32"
    a, b = flux_adapters["a"], flux_adapters["kohya"]
    latents = _flux_latents(seed=5)
    out = tmp_path / "cli"
    done = subprocess.run([sys.executable, "-m", "engines", "lora", str(artifact), "--lora", f"{a}:0.7", "--out",
                           str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    _runner_cli_gives_the_offline_image(artifact, f"{a}:0.7", out, tmp_path / "cli.png")
    offline = {"a": Pipeline.load(out)(latents=latents, **FLUX_CALL),
               "b": Pipeline.load(apply_loras(artifact, {b: 0.7}, tmp_path / "b"))(latents=latents, **FLUX_CALL)}
    pipe = Pipeline.load(artifact)
    base = pipe(latents=latents, **FLUX_CALL)
    for key, loras in (("a", {a: 0.7}), ("b", {b: 0.7}), ("a", {a: 0.7}), ("none", {})):
        pipe.set_loras(loras)
        assert np.array_equal(pipe(latents=latents, **FLUX_CALL), offline.get(key, base)), key
    assert not np.array_equal(offline["a"], offline["b"])


def test_flux_single_block_mlp_input_changes_exactly_its_slice(flux_tiny_build, flux_adapters, tmp_path):
    """fuse_qkv fuses a single block's q, k, v and MLP input (they read one tensor): an adapter on
    proj_mlp alone changes the fused weight in proj_mlp's columns only."""
    from lora_adapters import read_raw, write_raw
    from runners.adapters.lora import adapted_submodules

    artifact = flux_tiny_build.folder / "ort-fp32"
    tensors, metadata = read_raw(flux_adapters["a"])
    only = write_raw(tmp_path / "mlp.safetensors", {k: v for k, v in tensors.items() if ".proj_mlp." in k}, metadata)
    data = manifest(artifact)
    table, base = submodule_tables(artifact, data)["transformer"], artifact_weights(artifact)
    changed = adapted_submodules(artifact, data, {only: 1.0})["transformer"]
    assert len(changed) == 2  # one fused weight per single block
    for name, value in changed.items():
        record = table[name]
        assert sorted(p["key"].split(".")[-2] for p in record["parts"]) == ["proj_mlp", "to_k", "to_q", "to_v"]
        mlp = next(p for p in record["parts"] if p["key"].endswith("proj_mlp.weight"))
        diff = np.abs(value - base(name, record)).max(axis=0)
        inside = np.zeros(diff.shape, bool)
        inside[mlp["start"]:mlp["stop"]] = True
        assert mlp["axis"] == 1 and diff[inside].min() > 0 and diff[~inside].max() == 0, name


# flux-tiny's quantized artifacts with adapter A against ort-fp32 with it, as for sd3-tiny above. Measured on
# a CPU with VNNI: int8 58.4 dB (8-bit weights) with the adapter changing the image to 25.8 dB; fp8 (at 0.4) 39.6
# dB with a change to 34.2 dB. With 7-bit int8 weights (every CPU since), on a Zen 3: int8 51.3 dB, a change to
# 25.9 dB; fp8 39.8 dB, 34.1 dB. Bounds 5 dB under; margins under the measured gaps (25.4 and 5.7 dB).
FLUX_QUANTIZED_MIN_PSNR = {"int8": 46.0, "fp8": 34.6}
FLUX_CHANGE_MARGIN = {"int8": 20.0, "fp8": 3.0}


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_flux_quantized_artifacts_take_adapters(flux_tiny_build, flux_adapters, precision, tmp_path):
    """Flux's int8 and fp8 artifacts take adapters quantized again, at run time and offline alike."""
    from engines.api import build_artifact

    artifact = build_artifact(flux_tiny_build.folder, "ort", precision)
    adapters = {flux_adapters["a"]: ADAPTER_SCALE[precision]}
    latents = _flux_latents(seed=6)
    ref = Pipeline.load(flux_tiny_build.folder / "ort-fp32", loras=adapters)(latents=latents, **FLUX_CALL)
    base = Pipeline.load(artifact)(latents=latents, **FLUX_CALL)
    got = Pipeline.load(artifact, loras=adapters)(latents=latents, **FLUX_CALL)
    offline = Pipeline.load(apply_loras(artifact, adapters, tmp_path / "adapted"))(latents=latents, **FLUX_CALL)
    psnr, change = _psnr(ref, got), _psnr(base, got)
    print(f"flux {precision} with an adapter against fp32 with it: PSNR {psnr:.1f} dB; the adapter's change "
          f"{change:.1f} dB")
    assert psnr >= FLUX_QUANTIZED_MIN_PSNR[precision], psnr
    assert change < psnr - FLUX_CHANGE_MARGIN[precision], (change, psnr)
    assert np.abs(offline - got).max() <= 1e-4
