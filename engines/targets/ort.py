"""ONNX Runtime target: the engine is the prepared ONNX graph itself (CPU here, CUDA where present).

Building means writing the graph (external data beside it when over 2 GB) and proving that
ONNX Runtime accepts it by creating a session once.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from engines.targets import BuildInput, MemoryProfile, Target, TargetOptions


@dataclass(frozen=True)
class OrtOptions(TargetOptions):
    """Where the ONNX Runtime target's graphs keep the weights its passes leave unchanged. Not a setting: the
    engine is the same either way."""

    title: ClassVar[str] = "ONNX Runtime"

    link_weights: bool = False  # in a hard link of the export's weight file rather than a copy

    @classmethod
    def add_arguments(cls, group) -> None:
        group.add_argument("--ort-link-weights", action="store_true",
                           help="keep the weights the passes leave unchanged in a hard link of the export's weight "
                                "file (NAME.onnx.linked.data) instead of copying them: no disk beside the export for "
                                "a real-size model, but the artifact alone also carries the weights a pass replaced "
                                "(fuse_qkv's separate Q, K and V); default: a copy of what the graph reads")

    @classmethod
    def from_args(cls, args) -> OrtOptions:
        return cls(args.ort_link_weights)


def build_submodule(sub: BuildInput, out_dir: Path, options: OrtOptions) -> tuple[list[str], dict]:
    import json

    import onnxruntime as ort

    from engines.passes.ort_tools import SESSION_CONFIG_KEY, SESSION_OPTIONS_KEY
    from runners.backends.ort import session_settings
    from runners.manifest import save_graph

    model = sub.model
    out = out_dir / f"{sub.name}.onnx"
    # Every weight with a provenance in external data, whatever its size: a runner applying an
    # adapter reads and replaces them there (runners/adapters/lora.py), which it could not inside the protobuf.
    files = save_graph(model, out, external=set(sub.weights or ()), link=options.link_weights)
    # What the passes asked of ONNX Runtime (fp8: session.disable_quant_qdq; the memory passes: the
    # node order kept): this check opens the session with it, and the manifest records it for the runner.
    record = {key: json.loads(model.metadata_props[meta]) for key, meta in
              (("session_config", SESSION_CONFIG_KEY), ("session_options", SESSION_OPTIONS_KEY))
              if meta in model.metadata_props}
    session_options = ort.SessionOptions()
    extra = session_settings(session_options, record.get("session_config"), record.get("session_options"))
    # Basic optimizations: the check proves the graph loads and every node has a kernel, and on a
    # CPU the full level would first make float32 copies of fp16 weights (twice their size again).
    session_options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    ort.InferenceSession(str(out), session_options, providers=["CPUExecutionProvider"], **extra)  # fails here, not at deploy
    return files, record


TARGETS = [Target(
    name="ort",
    backend="ort",
    backend_module="onnxruntime",
    backend_distributions=("onnxruntime", "onnxruntime-gpu"),
    install_hint="pip install 'diffusion-aot[cpu]' (or [gpu] for onnxruntime-gpu)",
    precisions=("fp32", "fp16", "int8", "fp8"),
    # onnxruntime 1.32's CPU provider: a bfloat16 MatMul has no kernel, and Conv's schema does not
    # admit bfloat16 (checked on one-node graphs), so bf16 would only add casts around fp32 work.
    refuses={"bf16": "ONNX Runtime's CPU has no bf16 MatMul or Conv kernel"},
    passes=("fold_constants", "infer_shapes", "remove_dead_nodes", "fuse_qkv", "fuse_attention"),
    build_submodule=build_submodule,
    options=OrtOptions,
    # Fusion, then schedule, then recompute on the fused and scheduled graph. The arena and buffer
    # reuse settings are the ones measured best on sd3-bench's VAE at 1024x1024 within 1.15x of the
    # default's time (BENCHMARKS.md): without the arena, ONNX Runtime's buffer reuse keeps the
    # decoder lowest; the encoder's peak is lowest with the arena and no reuse (its planner keeps a
    # reused buffer alive between its uses). sd15-bench's UNet at 512x512, batch 2, peaks lowest
    # with ONNX Runtime's arena and reuse both on (BENCHMARKS.md, "Activation memory: unet").
    memory=MemoryProfile(("fuse_elementwise", "schedule_memory", "remat"),
                         {"enable_cpu_mem_arena": False, "enable_mem_reuse": True},
                         {"vae_encoder": {"enable_cpu_mem_arena": True, "enable_mem_reuse": False},
                          "unet": {"enable_cpu_mem_arena": True, "enable_mem_reuse": True}}),
)]
