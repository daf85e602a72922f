"""ONNX Runtime target: the engine is the prepared ONNX graph itself (CPU here, CUDA where present).

Building means writing the graph (external data beside it when over 2 GB) and proving that
ONNX Runtime accepts it by creating a session once.
"""
from __future__ import annotations

from pathlib import Path

from engines.targets import Target

_TWO_GB = 2**31


def build_submodule(onnx_path: Path, out_dir: Path, name: str) -> list[str]:
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(onnx_path), load_external_data=True)
    out = out_dir / f"{name}.onnx"
    large = model.ByteSize() > _TWO_GB
    onnx.save_model(model, str(out), save_as_external_data=large, location=f"{name}.onnx.data")
    del model
    ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])  # fails here, not at deploy time
    return [out.name] + ([f"{name}.onnx.data"] if large else [])


TARGET = Target(
    name="ort",
    backend_module="onnxruntime",
    backend_distributions=("onnxruntime", "onnxruntime-gpu"),
    install_hint="pip install 'diffusion-aot[cpu]' (or [gpu] for onnxruntime-gpu)",
    precisions=("fp32",),
    build_submodule=build_submodule,
)
