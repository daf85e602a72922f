"""OpenVINO sessions: numpy in and out, no torch. A session compiles the artifact's IR with the
config its manifest records (INFERENCE_PRECISION_HINT), or imports the model compiled at build time
(`--ov-device`) so that the first call does not compile. Outputs are copies the caller owns: an
infer request reuses its output tensors on the next call."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def _core():
    try:
        import openvino as ov
    except ImportError as e:
        raise RuntimeError(f"this artifact runs on OpenVINO, which is not installed ({e.name}): "
                           "pip install 'diffusion-aot[openvino]'") from None
    return ov.Core()


class OpenVinoSession:
    def __init__(self, path, threads: int | None = None, session_config: dict | None = None,
                 session_options: dict | None = None, profile: bool = False, providers: list[str] | None = None):
        """`session_config`: the OpenVINO properties the artifact was built with (its precision hint);
        `session_options`: the device and, when built with `--ov-device`, its compiled model's file.
        `providers` are ONNX Runtime's: an OpenVINO artifact refuses them rather than ignore them."""
        if providers:
            raise ValueError(f"{path}: providers choose ONNX Runtime's execution providers; this is an OpenVINO "
                             "model (its device was chosen at build time: --ov-device)")
        path = Path(path)
        core = _core()
        options = dict(session_options or {})
        self.device = options.get("device", "CPU")
        if self.device not in core.available_devices:
            raise RuntimeError(f"{path}: OpenVINO device '{self.device}' is not present on this machine; it has: "
                               f"{', '.join(core.available_devices)}")
        config = dict(session_config or {})
        if threads:
            config["INFERENCE_NUM_THREADS"] = threads
        if profile:  # per-layer counters, read back with `request.get_profiling_info()`
            config["PERF_COUNT"] = True
        self.imported = False  # whether the build's compiled model was used (no compile here)
        blob = options.get("compiled_model")
        if blob:
            try:
                self.compiled = core.import_model((path.parent / blob).read_bytes(), self.device, config)
                self.imported = True
            except RuntimeError as e:  # another OpenVINO release or CPU: compiling the IR gives the same model
                print(f"[runners] {path.name}: OpenVINO could not import {blob} "
                      f"({str(e).strip().splitlines()[-1]}); compiling the IR instead", file=sys.stderr, flush=True)
        if not self.imported:
            self.compiled = core.compile_model(path, self.device, config)
        self.request = self.compiled.create_infer_request()
        self.output_names = [o.get_any_name() for o in self.compiled.outputs]

    def run(self, feeds: dict[str, np.ndarray], release: bool = False) -> dict[str, np.ndarray]:
        """`release=True` on a stage's last call hands the plugin's working memory back."""
        # share_inputs: the call is synchronous and reads the caller's arrays in place;
        # share_outputs=False: the results are copies, not views of tensors the next call overwrites.
        results = self.request.infer(feeds, share_inputs=True, share_outputs=False)
        outputs = {name: results[port] for name, port in zip(self.output_names, self.compiled.outputs)}
        if release:
            self.compiled.release_memory()
        return outputs
