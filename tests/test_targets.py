"""One plug-in point per target: a target is one module of engines/targets (its options, flags,
precisions and builder) plus the runner's backend it names, one module of runners/backends; the
registries find both. A target's options are refused on every other target, on the command line
and in the Python API, and never enter another target's cache key."""
from __future__ import annotations

import dataclasses
import sys
import textwrap

import numpy as np
import pytest

import engines.targets
import runners.backends
from engines.__main__ import main as engines_main
from engines.targets import TargetError, registry, target_options

# The toy target: its engine is the prepared graph under its own suffix, opened by the toy backend.
TOY_TARGET = '''
"""A toy target: the prepared graph saved as is, for the toy backend."""
from engines.targets import Target
from engines.targets.ort import TARGETS as ORT
from runners.manifest import save_graph


def build_submodule(sub, out_dir, options):
    return save_graph(sub.model, out_dir / f"{sub.name}.toy.onnx", external=set(sub.weights or ())), {}


TARGETS = [Target(name="toy", backend="toy", backend_module="onnxruntime", backend_distributions=("onnxruntime",),
                  install_hint="pip install onnxruntime", precisions=("fp32",), passes=ORT[0].passes,
                  build_submodule=build_submodule)]
'''
TOY_BACKEND = '''
"""The toy backend: ONNX Runtime sessions that count their calls."""
from runners.backends import Backend
from runners.backends.ort import OrtSession


class ToySession(OrtSession):
    calls = {}  # {engine file name: runs}

    def __init__(self, path, **options):
        self.file = path.name
        super().__init__(path, **options)

    def run(self, feeds, release=False):
        ToySession.calls[self.file] = ToySession.calls.get(self.file, 0) + 1
        return super().run(feeds, release)


BACKENDS = [Backend("toy", "Toy", lambda path, device=None, **options: ToySession(path, **options), threads=True)]
'''


def _plug_in(monkeypatch, tmp_path, package, source: str) -> None:
    """`source` as the module `toy` of `package`, found there as a module of its own folder is."""
    folder = tmp_path / package.__name__.replace(".", "_")
    folder.mkdir()
    (folder / "toy.py").write_text(textwrap.dedent(source))
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(folder)])
    monkeypatch.delitem(sys.modules, f"{package.__name__}.toy", raising=False)


@pytest.fixture
def toy_target(monkeypatch, tmp_path):
    _plug_in(monkeypatch, tmp_path, engines.targets, TOY_TARGET)
    yield
    sys.modules.pop("engines.targets.toy", None)


@pytest.fixture
def toy_backend(monkeypatch, tmp_path):
    _plug_in(monkeypatch, tmp_path, runners.backends, TOY_BACKEND)
    yield
    sys.modules.pop("runners.backends.toy", None)


def test_every_target_names_a_backend_the_runner_has():
    backends = runners.backends.registry()
    assert {t.backend for t in registry().values()} <= set(backends)
    assert sorted(registry()) == ["openvino", "ort", "trt", "trt-rtx"]
    assert sorted(backends) == ["openvino", "ort", "triton", "trt", "trt-rtx"]


def test_a_target_without_its_backend_fails_the_registry(toy_target):
    with pytest.raises(TargetError, match="target 'toy' names the runner backend 'toy', which runners/backends does "
                                          r"not have \(it has: .*\): add runners/backends/toy.py"):
        registry()


def test_a_toy_target_builds_and_runs_sd3_tiny_end_to_end(toy_target, toy_backend, tiny_build, tmp_path):
    """Adding a target is one file in engines/targets and one in runners/backends: nothing else names it."""
    import shutil

    from engines.api import build_artifact
    from runners import Pipeline
    from conftest import manifest

    shutil.copytree(tiny_build / "onnx", tmp_path / "build" / "onnx")
    assert "toy" in registry() and "toy" in runners.backends.registry()
    folder = build_artifact(tmp_path / "build", "toy", "fp32")
    m = manifest(folder)
    assert (folder.name, m["target"], m["backend"]) == ("toy-fp32", "toy", "toy")
    assert {s["file"] for s in m["submodules"].values()} == {f"{n}.toy.onnx" for n in m["submodules"]}
    toy = sys.modules["runners.backends.toy"].ToySession
    toy.calls.clear()
    kwargs = dict(height=64, width=64, num_inference_steps=3, guidance_scale=5.0, seed=0, output_type="np")
    with Pipeline.load(folder, threads=1) as pipe:
        assert {type(s).__name__ for s in pipe.sessions.values()} == {"ToySession"}
        image = pipe("a photo of a cat", **kwargs)
    assert toy.calls["transformer.toy.onnx"] == 3 and toy.calls["vae_decoder.toy.onnx"] == 1
    with Pipeline.load(tiny_build / "ort-fp32", threads=1) as pipe:  # the same graphs on ONNX Runtime
        reference = pipe("a photo of a cat", **kwargs)
    np.testing.assert_allclose(image, reference, atol=1e-6)


@pytest.mark.parametrize("flags, message", [
    (["--target", "ort", "--static"],
     "--static is an option of the trt, trt-rtx targets; target 'ort' takes none of it"),
    (["--target", "ort", "--ov-sizes", "512x512"],
     "--ov-sizes is an option of the openvino target; target 'ort' takes none of it"),
    (["--target", "trt-rtx", "--ov-device", "CPU", "--ov-shapes", "dynamic"],
     "--ov-device, --ov-shapes are options of the openvino target; target 'trt-rtx' takes none of them"),
    (["--target", "trt", "--ov-sizes", "512x512"],
     "--ov-sizes is an option of the openvino target; target 'trt' takes none of it"),
    (["--target", "openvino", "--workspace-mib", "512"],
     "--workspace-mib is an option of the trt, trt-rtx targets; target 'openvino' takes none of it"),
])
def test_another_targets_flags_are_refused_in_one_line(tmp_path, capsys, flags, message):
    """Refused before anything is read or built: the build folder needs no export for this."""
    assert engines_main([str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {message}"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("target, kwargs, message", [
    ("ort", {"static": None}, "static is an option of the trt, trt-rtx targets; target 'ort' takes none of it"),
    ("trt-rtx", {"device": "CPU"}, "device is an option of the openvino target; target 'trt-rtx' takes none of it"),
    ("openvino", {"speed": 2}, "speed is no option of any target; target 'openvino' takes: device, shapes, sizes, weights"),
])
def test_the_python_api_refuses_them_as_the_cli_does(target, kwargs, message):
    with pytest.raises(TargetError, match=f"^{message}$"):
        target_options(target, **kwargs)


def test_another_targets_options_object_is_refused(tmp_path):
    from engines.api import build_artifact
    from engines.targets.openvino import OpenVinoOptions

    with pytest.raises(TargetError, match="^OpenVinoOptions is an option of the openvino target; target 'ort' takes "
                                          "none of it$"):
        build_artifact(tmp_path, "ort", "fp32", options=OpenVinoOptions(device="CPU"))


def test_a_targets_cache_key_holds_its_own_settings_only():
    from engines.targets.openvino import OpenVinoOptions
    from engines.targets.trt import TrtOptions

    assert set(TrtOptions().settings()) == {"static", "compute_capabilities", "workspace_mib"}
    assert OpenVinoOptions(device="CPU", sizes=((64, 64),)).settings() == {"device": "CPU", "ov_sizes": [[64, 64]]}
    assert registry()["ort"].options().settings() == {}


def test_precisions_a_target_takes_its_own_way_are_its_own():
    """engines.precisions names no target; OpenVINO declares the precisions it takes its own way."""
    from engines.precisions import Recipe

    assert [f.name for f in dataclasses.fields(Recipe)] == ["passes", "denoiser"]
    own = registry()["openvino"].own_precisions
    assert set(own) == set(registry()["openvino"].precisions) == {"fp32", "bf16", "fp16", "int8"}
    assert own["int8"].quantize and not own["bf16"].quantize
    assert all(not t.own_precisions for name, t in registry().items() if name != "openvino")
