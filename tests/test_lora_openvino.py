"""LoRA on OpenVINO artifacts (fp32, bf16, int8) of sd3-tiny, and fp32 of sd15-, sdxl- and flux-tiny:
adapters as low-rank branches beside the IR's linear layers (runners/adapters/branches.py), the base
weights as built (int8 ones too). fp32 against diffusers' fused LoRA within 1/255; bf16 and int8
against ort-fp32 with the same adapter, bounded in PSNR 5 dB under what was measured, each far closer
to it than the adapter's own change of the image."""
from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("openvino")

from bench.accuracy import psnr  # noqa: E402
from engines.api import build_artifact  # noqa: E402
from engines.lora import apply_loras  # noqa: E402
from engines.targets.openvino import OpenVinoOptions  # noqa: E402
from runners import Pipeline  # noqa: E402
from runners.adapters.lora import LoraError  # noqa: E402
from lora_adapters import ATTENTION, CLIP_ATTENTION, make_adapter  # noqa: E402
from test_lora import CALL, FLUX_CALL, ONE_LEVEL, _flux_latents, _latents, _reference  # noqa: E402

SD3 = dict(max_sequence_length=32)
# PSNR (dB) against ort-fp32 with adapter a at 0.4, 64x64, 4 steps, latents seed 0. Measured: bf16 40.1 and
# 41.7, int8 34.2 and 32.8 on two draws of the tiny weights (the adapter itself changes the image to 23.5 dB);
# the bounds sit 5 dB under the lower. int8's rank-0 branches against int8 as built: 36.7 dB. At scale 0.8
# int8 measured 24.0 dB (bf16 34.5) against a change of 19.4: its activation quantizers keep the ranges
# calibrated without the adapter, and a strong adapter's activations leave them (docs/lora.md).
# With 7-bit int8 weights (every CPU since: docs/precision.md), on a Zen 3: int8 33.6 dB, bf16 (run in fp32
# there) 64.4 dB.
BOUNDS = {"bf16": 35.1, "int8": 27.8}
MARGIN = {"bf16": 8.0, "int8": 8.0}


@pytest.fixture(scope="module")
def ov_artifacts(tiny_build):
    """test_openvino.py's artifacts (built once: the build cache reuses them)."""
    return {"fp32": build_artifact(tiny_build, "openvino", "fp32"),
            "bf16": build_artifact(tiny_build, "openvino", "bf16", options=OpenVinoOptions(device="CPU")),
            "int8": build_artifact(tiny_build, "openvino", "int8")}


def test_fp32_with_an_adapter_matches_diffusers_offline_and_at_run_time(tiny_source, ov_artifacts, sd3_adapters,
                                                                        tmp_path):
    from diffusers import StableDiffusion3Pipeline

    fp32, adapters = ov_artifacts["fp32"], {sd3_adapters["a"]: 0.8}
    latents = _latents(16)
    ref = _reference(StableDiffusion3Pipeline, tiny_source.folder, adapters, latents, **SD3)
    runtime = Pipeline.load(fp32, loras=adapters)(latents=latents, **CALL, **SD3)
    assert np.abs(runtime - ref).max() <= ONE_LEVEL
    offline = apply_loras(fp32, adapters, tmp_path / "art")
    assert np.array_equal(Pipeline.load(offline)(latents=latents, **CALL, **SD3), runtime)
    # the offline artifact is the source's engines, linked, and the adapter file
    for name in os.listdir(fp32):
        if name.endswith((".xml", ".bin")):
            assert os.stat(offline / name).st_ino == os.stat(fp32 / name).st_ino, name
    assert len(list((offline / "loras").iterdir())) == 1


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_bf16_and_int8_with_an_adapter_against_ort_fp32(precision, ov_artifacts, tiny_artifact, sd3_adapters):
    adapters = {sd3_adapters["a"]: 0.4}
    latents = _latents(16)
    ref = Pipeline.load(tiny_artifact, loras=adapters)(latents=latents, **CALL, **SD3)
    base = Pipeline.load(tiny_artifact)(latents=latents, **CALL, **SD3)
    got = Pipeline.load(ov_artifacts[precision], loras=adapters)(latents=latents, **CALL, **SD3)
    error, change = psnr(ref, got), psnr(ref, base)
    print(f"openvino-{precision} with an adapter against ort-fp32 with it: PSNR {error:.1f} dB "
          f"(the adapter's change: {change:.1f} dB)")
    assert error >= BOUNDS[precision]
    assert error >= change + MARGIN[precision]  # the precision's error is smaller than what the adapter does


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_switching_a_b_a_none_is_exact_and_compiles_once(precision, ov_artifacts, sd3_adapters):
    """Every set gives the same image whichever sets came before it (TensorRT #3628's blend cannot
    happen); only an engine's first adapter compiles (its branched model); none is the plain artifact's image
    exactly on every precision (it runs the model as built, kept beside the branched one), and so is
    none after loading with an adapter."""
    a, b = {sd3_adapters["a"]: 1.0}, {sd3_adapters["b"]: 1.0}
    latents = _latents(16, seed=2)
    pipe = Pipeline.load(ov_artifacts[precision])
    base = pipe(latents=latents, **CALL)
    seen, compiles = [], []
    for loras in (a, b, a, {}, b):
        pipe.set_loras(loras)
        seen.append(pipe(latents=latents, **CALL))
        compiles.append(sum(s.compiles for s in pipe.sessions.values()))
    assert np.array_equal(seen[2], seen[0]) and np.array_equal(seen[4], seen[1])
    assert not np.array_equal(seen[0], seen[1])
    # a compiles the branched models of the engines it touches, b that of text_encoder_2 (a leaves it); after
    # that no switch compiles anything, none included (the models as built stay beside the branched ones)
    assert compiles[0] < compiles[1] and compiles[2:] == [compiles[1]] * 3
    assert np.array_equal(seen[3], base)
    loaded = Pipeline.load(ov_artifacts[precision], loras=a)
    assert np.array_equal(loaded(latents=latents, **CALL), seen[0])
    loaded.set_loras({})
    assert np.array_equal(loaded(latents=latents, **CALL), base)


def test_an_adapter_on_a_layer_no_branch_reaches_is_refused(ov_artifacts, sd3_adapters, tmp_path):
    """The patch embedding is a convolution: refused in one line, saying what to do."""
    from lora_adapters import read_raw, write_raw

    tensors, metadata = read_raw(sd3_adapters["a"])
    tensors["transformer.pos_embed.proj.lora_A.weight"] = np.ones((4, 16, 2, 2), np.float32)
    tensors["transformer.pos_embed.proj.lora_B.weight"] = np.ones((32, 4, 1, 1), np.float32)
    conv = write_raw(tmp_path / "conv.safetensors", tensors, metadata)
    with pytest.raises(LoraError, match=r"pos_embed.proj is a convolution; adapters reach an OpenVINO artifact's "
                                        r"linear layers only"):
        Pipeline.load(ov_artifacts["fp32"], loras={conv: 1.0})


# --- the other families: SD1.5, SDXL (the U-Net's attention and the CLIPs'), Flux (both kinds of block) ---
FAMILY_ADAPTERS = {  # linear layers only: the branches reach no convolution (the U-Nets' proj_in is one)
    "sd15": {"unet": ATTENTION, "text_encoder": CLIP_ATTENTION},
    "sdxl": {"unet": ATTENTION, "text_encoder": CLIP_ATTENTION, "text_encoder_2": ["q_proj", "v_proj"]},
    "flux": {"transformer": ATTENTION + ["proj_mlp", "norm1.linear"], "text_encoder": CLIP_ATTENTION},
}


@pytest.mark.parametrize("family", sorted(FAMILY_ADAPTERS))
def test_each_familys_fp32_with_an_adapter_matches_diffusers(family, request, tmp_path):
    """openvino-fp32 of sd15-, sdxl- and flux-tiny with an adapter, at run time and applied offline,
    against diffusers' fused LoRA within 1/255; the adapter must change diffusers' image."""
    from diffusers import FluxPipeline, StableDiffusionPipeline, StableDiffusionXLPipeline

    build = request.getfixturevalue(f"{family}_tiny_build")
    cls = {"sd15": StableDiffusionPipeline, "sdxl": StableDiffusionXLPipeline, "flux": FluxPipeline}[family]
    adapter = make_adapter(cls, build.source.folder, tmp_path / "adapter", FAMILY_ADAPTERS[family], seed=5)
    call = FLUX_CALL if family == "flux" else CALL
    latents = _flux_latents(seed=5) if family == "flux" else _latents(4, seed=5)
    reference = dict(max_sequence_length=16) if family == "flux" else {}
    ref = _reference(cls, build.source.folder, {adapter: 0.8}, latents, **reference)
    assert np.abs(ref - _reference(cls, build.source.folder, {}, latents, **reference)).max() > 0.05
    fp32 = build_artifact(build.folder, "openvino", "fp32")
    runtime = Pipeline.load(fp32, loras={adapter: 0.8})(latents=latents, **call)
    print(f"{family} openvino-fp32 with an adapter: max abs error {np.abs(runtime - ref).max():.1e}")
    assert np.abs(runtime - ref).max() <= ONE_LEVEL
    offline = apply_loras(fp32, {adapter: 0.8}, tmp_path / "art")
    assert np.array_equal(Pipeline.load(offline)(latents=latents, **call), runtime)
