"""OpenVINO sessions: numpy in and out, no torch. A session compiles the artifact's IR with the
config its manifest records (INFERENCE_PRECISION_HINT), or imports the model compiled at build time
(`--ov-device`) so that the first call does not compile. Outputs are copies the caller owns: an
infer request reuses its output tensors on the next call.

Shapes (the manifest's `session_options.shapes`): "dynamic" compiles one model for every shape at
load; "per-size" compiles, at the first call of each set of input shapes, the IR reshaped to them,
and keeps the most recent few. Models compiled static at build time (`static_models`) are imported
at the first call of their shapes instead.

Adapters (`lora_layers`, `set_lora_factors`): the first adapter compiles the model again with a low-rank
branch beside every linear layer the build recorded (runners/backends/_openvino_lora.py); from then on,
switching adapters only changes the branches' inputs. With no adapter on the engine it runs the model as
built, kept beside the branched one: "none" is the plain artifact's image exactly on every precision (the
branches at rank 0 change how bf16 and int8 compile the base path: up to 0.08 in [0, 1] on sd3-tiny), at
the memory of a second compiled model and no switch time."""
from __future__ import annotations

import os
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np

from runners.backends import Backend, cpu_threads
from runners.backends._openvino_lora import add_branches, branch_feeds

# Compiled per-size models kept at once: each can hold its own copy of the weights (a plugin may repack them).
KEEP_SIZES = 2


# OpenVINO's CPU plugin (2026.4) dies with SIGFPE, "Floating point exception", compiling some bf16 graphs
# (sd3-tiny's T5) to run on one thread of a CPU with AMX: one inference thread, or one core
# (`taskset -c 0`: openvinotoolkit/openvino#33300). Capped below AMX (AVX512_BF16 and VNNI: the same
# precisions), oneDNN compiles and runs them. It reads the cap once, at the process's first compile.
ONE_THREAD_ISA_CAP = ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), ()))


def avoid_one_thread_amx_crash(threads: int | None) -> bool:
    """Cap oneDNN below AMX, where this process will compile OpenVINO models for one thread on a CPU with
    AMX; before its first compile, and unless the cap is set already. Whether it capped."""
    variable, value = ONE_THREAD_ISA_CAP
    one_core = hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) == 1
    if variable in os.environ or not (threads == 1 or one_core) or "amx_tile" not in _cpu_flags():
        return False
    os.environ[variable] = value
    return True


def openvino_core(threads: int | None = None):
    """OpenVINO's Core, for sessions (or builds) of `threads` CPU threads (None: every core)."""
    try:
        import openvino as ov
    except ImportError as e:
        raise RuntimeError(f"this artifact runs on OpenVINO, which is not installed ({e.name}): "
                           "pip install 'diffusion-aot[openvino]'") from None
    avoid_one_thread_amx_crash(threads)
    return ov.Core()


def _key(shapes: dict) -> tuple:
    return tuple(sorted((name, tuple(shape)) for name, shape in shapes.items()))


class _Compiled:
    """One compiled model and its infer request; `names` are its outputs' names in the IR. A compiled
    output can carry more names than the IR's: where the plugin drops a Convert at an output (an fp16
    export's cast back to float32, with the bf16 hint), the output takes its input's names too, and
    `get_any_name` may return one of those."""

    def __init__(self, compiled, names: list[str]):
        self.compiled, self.request = compiled, compiled.create_infer_request()
        self.output_names = names
        # OpenVINO 2026.4's CPU plugin fuses an LLM's rotary embedding into a RoPE node, which release_memory
        # leaves without its buffers: every later call of the same shape fails ("Memory has not been
        # allocated"; Z-Image's Qwen3 encoder, its prompt and negative prompt). Such a model keeps its memory.
        layers = {op.get_rt_info()["layerType"].astype(str) for op in compiled.get_runtime_model().get_ops()}
        self.releasable = "RoPE" not in layers


class OpenVinoSession:
    def __init__(self, path, threads: int | None = None, session_config: dict | None = None,
                 session_options: dict | None = None, profile: bool = False, providers: list[str] | None = None,
                 lora_layers: list[dict] | None = None, lora_factors: dict | None = None):
        """`session_config`: the OpenVINO properties the artifact was built with (its precision hint);
        `session_options`: the device, how the model is shaped, and the compiled models built with it.
        `providers` are ONNX Runtime's: an OpenVINO artifact refuses them rather than ignore them.
        `lora_layers`: the layers an adapter can reach (runners.adapters.branches.branch_layers);
        `lora_factors`: the adapters to start with ({layer: (A, B)}, see `set_lora_factors`); None: the
        model as built, without branches."""
        if providers:
            raise ValueError(f"{path}: providers choose ONNX Runtime's execution providers; this is an OpenVINO "
                             "model (its device was chosen at build time: --ov-device)")
        self.path = Path(path)
        threads = cpu_threads(threads)
        self.core = openvino_core(threads)
        options = dict(session_options or {})
        self.device = options.get("device", "CPU")
        if self.device not in self.core.available_devices:
            raise RuntimeError(f"{path}: OpenVINO device '{self.device}' is not present on this machine; it has: "
                               f"{', '.join(self.core.available_devices)}")
        self.config = dict(session_config or {})
        if threads:
            self.config["INFERENCE_NUM_THREADS"] = threads
        if profile:  # per-layer counters, read back with `session.last.request.get_profiling_info()`
            self.config["PERF_COUNT"] = True
        self.shapes = options.get("shapes", "dynamic")
        self.static_files = {_key(s["shapes"]): s["file"] for s in options.get("static_models", [])}
        self.compiles = 0  # models compiled here rather than imported from the build's blobs
        self.per_size: OrderedDict[tuple, _Compiled] = OrderedDict()
        self.dynamic = None
        self.blob = options.get("compiled_model")
        self.output_names = [o.get_any_name() for o in self.core.read_model(self.path).outputs]
        self.lora_layers = list(lora_layers or ())
        self.branched = False  # the adapters' inputs go to the branched model (an adapter touches the engine)
        self.dynamic_branched = None  # the branched model, dynamic shapes (compiled at the first adapter)
        self.lora_feeds: dict[str, np.ndarray] = {}
        if self.shapes == "dynamic" and not lora_factors:
            self.dynamic = _Compiled((self._import(self.blob) if self.blob else None) or self._compile(),
                                     self.output_names)
        if lora_factors:
            self.set_lora_factors(lora_factors)
        self.last = self.dynamic_branched if self.branched else self.dynamic  # the model run last

    def set_lora_factors(self, factors: dict) -> None:
        """Switch adapters ({layer: (A, B)}; {} for none) before the next call. The first adapter compiles
        the branched model; after that a switch only replaces the branches' inputs, and none runs the
        model as built (both stay compiled)."""
        if not self.lora_layers:
            raise ValueError(f"{self.path}: this engine records no layer an adapter can reach (built before "
                             "adapters reached OpenVINO artifacts: build it again with python -m engines)")
        unknown = set(factors) - {layer["matmul"] for layer in self.lora_layers}
        if unknown:
            raise ValueError(f"{self.path}: adapters name layers the engine does not have: {sorted(unknown)[:3]}")
        self.branched = bool(factors)
        self.lora_feeds = branch_feeds(self.lora_layers, factors) if factors else {}
        if self.shapes != "dynamic":
            return
        if self.branched and self.dynamic_branched is None:
            self.dynamic_branched = _Compiled(self._compile(branched=True), self.output_names)
        if not self.branched and self.dynamic is None:  # opened with adapters, switched to none
            self.dynamic = _Compiled((self._import(self.blob) if self.blob else None) or self._compile(),
                                     self.output_names)

    def _import(self, blob: str):
        try:
            return self.core.import_model((self.path.parent / blob).read_bytes(), self.device, self.config)
        except RuntimeError as e:  # another OpenVINO release or CPU: compiling the IR gives the same model
            print(f"[runners] {self.path.name}: OpenVINO could not import {blob} "
                  f"({str(e).strip().splitlines()[-1]}); compiling the IR instead", file=sys.stderr, flush=True)
            return None

    def _compile(self, shapes: dict | None = None, branched: bool = False):
        model = self.core.read_model(self.path)
        if branched:
            add_branches(model, self.lora_layers)
        if shapes:
            model.reshape({name: list(shape) for name, shape in shapes.items()})
        self.compiles += 1
        return self.core.compile_model(model, self.device, self.config)

    @property
    def imported(self) -> bool:
        """Whether every model this session has run came from the build's blobs (nothing compiled here)."""
        return self.compiles == 0

    def _model_for(self, feeds: dict[str, np.ndarray]) -> _Compiled:
        key = _key({name: array.shape for name, array in feeds.items()})
        blob = None if self.branched else self.static_files.get(key)  # the build's blobs are plain models
        if blob is None and self.shapes == "dynamic":
            return self.dynamic_branched if self.branched else self.dynamic
        cached = (self.branched, key)
        if cached not in self.per_size:
            compiled = (self._import(blob) if blob else None) or self._compile(dict(key), self.branched)
            self.per_size[cached] = _Compiled(compiled, self.output_names)
            while len(self.per_size) > KEEP_SIZES:
                self.per_size.popitem(last=False)
        self.per_size.move_to_end(cached)
        return self.per_size[cached]

    def close(self) -> None:
        self.per_size.clear()
        self.dynamic = self.dynamic_branched = self.last = None

    def run(self, feeds: dict[str, np.ndarray], release: bool = False) -> dict[str, np.ndarray]:
        """`release=True` on a stage's last call hands the plugin's working memory back."""
        model = self.last = self._model_for(feeds)
        # share_inputs: the call is synchronous and reads the caller's arrays in place;
        # share_outputs=False: the results are copies, not views of tensors the next call overwrites.
        results = model.request.infer({**feeds, **self.lora_feeds}, share_inputs=True, share_outputs=False)
        outputs = {name: results[port] for name, port in zip(model.output_names, model.compiled.outputs)}
        if release and model.releasable:
            model.compiled.release_memory()
        return outputs


def _open(path, device=None, initializers=None, **options) -> OpenVinoSession:
    return OpenVinoSession(path, **options)


BACKENDS = [Backend("openvino", "OpenVINO", _open, threads=True, lora_branches=True, triton='backend: "openvino"',
                    device_hint=" (its device was chosen at build time: --ov-device)")]
