"""ONNX Runtime target: the engine is the prepared ONNX graph itself (CPU here, CUDA where present).

Building means writing the graph (external data beside it when over 2 GB) and proving that
ONNX Runtime accepts it by creating a session once.
"""
from __future__ import annotations

from pathlib import Path

from engines.targets import BuildInput, BuildOptions, Target

_TWO_GB = 2**31


def _weight_bytes(model) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def build_submodule(sub: BuildInput, out_dir: Path, options: BuildOptions) -> tuple[list[str], dict]:
    import json

    import onnx_ir as ir
    import onnxruntime as ort

    from engines.passes.ort_tools import SESSION_CONFIG_KEY

    model = sub.model
    out = out_dir / f"{sub.name}.onnx"
    data = f"{sub.name}.onnx.data" if _weight_bytes(model) > _TWO_GB else None
    # Weights are written one at a time from where they live (memory-mapped or computed lazily).
    ir.save(model, out, external_data=data)
    # The session config entries a pass asked for (fp8: session.disable_quant_qdq): this check opens
    # the session with them, and the manifest records them for the runner.
    session_config = json.loads(model.metadata_props.get(SESSION_CONFIG_KEY, "{}"))
    session_options = ort.SessionOptions()
    for key, value in session_config.items():
        session_options.add_session_config_entry(key, value)
    ort.InferenceSession(str(out), session_options, providers=["CPUExecutionProvider"])  # fails here, not at deploy
    return [out.name] + ([data] if data else []), ({"session_config": session_config} if session_config else {})


TARGETS = [Target(
    name="ort",
    backend_module="onnxruntime",
    backend_distributions=("onnxruntime", "onnxruntime-gpu"),
    install_hint="pip install 'diffusion-aot[cpu]' (or [gpu] for onnxruntime-gpu)",
    precisions=("fp32", "fp16", "int8", "fp8"),
    passes=("fold_constants", "infer_shapes", "remove_dead_nodes", "fuse_qkv", "fuse_attention"),
    build_submodule=build_submodule,
)]
