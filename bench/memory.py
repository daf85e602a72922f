"""The memory table: a VAE submodule at a large size, each run in a fresh process, ONNX Runtime's
defaults on the plain export against the `--memory` artifact with the settings its manifest
records, and the static analyzer's planned peak against the measured increase in RSS."""
from __future__ import annotations

import time
from pathlib import Path


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def run_once(path: str, shape: tuple, config: dict | None, options: dict | None) -> dict:
    """One call of the graph at `path` in this (fresh) process. `options` None: ONNX Runtime's own
    defaults; else the runner's session with these session config entries and options."""
    import numpy as np
    import onnxruntime as ort

    if options is None:
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    else:
        from runners.backends.ort import OrtSession

        session = OrtSession(path, session_config=config, session_options=options).session
    name = session.get_inputs()[0].name
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    before = _rss_mib("VmRSS")
    t0 = time.perf_counter()
    session.run(None, {name: x})
    seconds = time.perf_counter() - t0
    peak = _rss_mib("VmHWM")
    return {"seconds": seconds, "peak_mib": peak, "increase_mib": peak - before}


def planned_peak_mib(path: Path, dims: dict) -> float:
    from engines.memory.graph import load_graph
    from engines.memory.planner import plan

    return plan(load_graph(path, dims)).peak / 2**20
