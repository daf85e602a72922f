"""Profiling a run: Chrome traces per engine call and for the whole run, ONNX Runtime's operator
events nested in their call, a summary; and the same images as without profiling."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from runners import Pipeline

STEPS = 2
ORDER = ["text_encoder", "text_encoder_2", "text_encoder_3"] * 2 + ["transformer"] * STEPS + ["vae_decoder"]


@pytest.fixture(scope="module")
def profiled(tiny_artifact, tmp_path_factory):
    pipe = Pipeline.load(tiny_artifact)
    latents = np.random.default_rng(3).standard_normal((1, 16, 16, 16), dtype=np.float32)
    kwargs = dict(negative_prompt="blurry", height=128, width=128, num_inference_steps=STEPS, latents=latents,
                  output_type="np")
    out = tmp_path_factory.mktemp("profile")
    with_profile = pipe("a cat", profile=out, **kwargs)
    without = pipe("a cat", **kwargs)
    return out, with_profile, without, pipe


def _events(path):
    data = json.loads(path.read_text())
    assert isinstance(data["traceEvents"], list)
    for e in data["traceEvents"]:
        assert e["ph"] in ("X", "M") and "pid" in e and "tid" in e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0
    return data["traceEvents"]


def test_full_trace_has_every_call_in_order(profiled):
    out, *_ = profiled
    calls = sorted((e for e in _events(out / "trace.json") if e.get("cat") == "call"), key=lambda e: e["ts"])
    assert [e["name"].rsplit(".", 1)[0] for e in calls] == ORDER
    assert [e["name"] for e in calls if e["name"].startswith("transformer")] == ["transformer.step00",
                                                                                  "transformer.step01"]
    tracks = {e["args"]["name"]: e["tid"] for e in _events(out / "trace.json") if e["ph"] == "M"}
    assert list(tracks) == list(dict.fromkeys(ORDER))  # one track per submodule, in call order
    assert all(e["tid"] == tracks[e["name"].rsplit(".", 1)[0]] for e in calls)


def test_every_call_has_its_own_file_with_its_operators_nested(profiled):
    out, *_ = profiled
    files = sorted(p.name for p in out.glob("*.json") if p.name != "trace.json")
    assert len(files) == len(ORDER)
    for name in files:
        events = _events(out / name)
        (call,) = [e for e in events if e.get("cat") == "call"]
        ops = [e for e in events if e.get("cat") == "op"]
        assert call["name"] + ".json" == name
        assert ops, f"{name} has no ONNX Runtime operator events"
        for op in ops:
            assert op["tid"] == call["tid"]
            assert call["ts"] - 1e-3 <= op["ts"] and op["ts"] + op["dur"] <= call["ts"] + call["dur"] + 1e-3, op
    assert {e["args"]["op_name"] for e in _events(out / "transformer.step00.json") if e.get("cat") == "op"} >= {
        "MultiHeadAttention", "MatMul"}


def test_summary_and_unchanged_images(profiled):
    out, with_profile, without, pipe = profiled
    summary = (out / "summary.txt").read_text()
    assert "transformer" in summary and f"{STEPS:>5}" in summary.splitlines()[[
        i for i, line in enumerate(summary.splitlines()) if line.startswith("transformer ")][0]]
    assert "MatMul" in summary
    np.testing.assert_array_equal(with_profile, without)
    assert pipe.profiler is None and not hasattr(pipe.sessions["transformer"], "_profile_dir")


def test_cli_quick_profile(tiny_artifact, tmp_path):
    done = subprocess.run([sys.executable, "-m", "runners", str(tiny_artifact), "--prompt", "a cat", "--steps", "1",
                           "--height", "64", "--width", "64", "--profile", str(tmp_path / "prof"),
                           "--out", str(tmp_path / "cat.png")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "engine calls" in done.stdout and (tmp_path / "prof" / "transformer.step00.json").exists()
    assert len([e for e in _events(tmp_path / "prof" / "trace.json") if e.get("cat") == "call"]) == 8
