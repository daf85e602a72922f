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


def run_once(path: str, inputs: dict[str, tuple], config: dict | None, options: dict | None) -> dict:
    """One call of the graph at `path` in this (fresh) process on random `inputs` ({name: shape},
    float32). `options` None: ONNX Runtime's own defaults; else the runner's session with these
    session config entries and options."""
    import numpy as np
    import onnxruntime as ort

    if options is None:
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    else:
        from runners.backends.ort import OrtSession

        session = OrtSession(path, session_config=config, session_options=options).session
    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in inputs.items()}
    before = _rss_mib("VmRSS")
    t0 = time.perf_counter()
    session.run(None, feeds)
    seconds = time.perf_counter() - t0
    peak = _rss_mib("VmHWM")
    return {"seconds": seconds, "peak_mib": peak, "increase_mib": peak - before}


def planned_peak_mib(path: Path, dims: dict) -> float:
    from engines.memory.graph import load_graph
    from engines.memory.planner import plan

    return plan(load_graph(path, dims)).peak / 2**20


def graph_without(onnx_dir: Path, artifact: Path, submodule: str, drop: str, out_dir: Path) -> str:
    """The artifact's graph of `submodule` rebuilt from the export with the same passes, at the
    same planning dims, but `drop`: what that one pass changes can then be measured alone."""
    import onnx_ir as ir

    from engines.passes import PassContext, PassPipeline
    from runners.manifest import read_manifest

    source, built = read_manifest(onnx_dir, verify=False), read_manifest(artifact, verify=False)
    names = [r["name"] for r in built["submodules"][submodule]["passes"] if r["name"] != drop]
    dims = {**source["constants"], **{d: v[1] for d, v in source["dims"].items()}}
    context = PassContext(submodule, source["submodules"][submodule], None, dims, built["memory"]["budget"])
    model, _ = PassPipeline(names)(ir.load(onnx_dir / source["submodules"][submodule]["file"]), submodule,
                                   context=context)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{submodule}.onnx"
    ir.save(model, path, external_data=f"{submodule}.onnx.data")
    return str(path)


def graph_gflops(path: str, dims: dict) -> float:
    from engines.memory.graph import graph_flops

    return graph_flops(Path(path), dims) / 1e9
