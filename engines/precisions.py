"""Precision recipes: the passes that turn a target's prepared fp32 graphs into each precision.

Precision lives in the graph (ONNX Runtime, TensorRT and TensorRT-RTX read the same typed ONNX),
so a precision is a list of passes run after the target's own. The denoiser (the submodule run
at every step, named by the export manifest) may take a recipe of its own: fp8 quantizes only it,
and every other submodule runs in fp16. A target that takes a precision its own way (OpenVINO: an
inference-precision setting, and its own quantizer) declares it (`Target.own_precisions`, a
`TargetRecipe` per precision) and runs none of these passes.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TargetRecipe:
    """A precision as a target that takes it its own way builds it."""

    runtime: dict[str, str]  # settings recorded for its runtime (OpenVINO: {"INFERENCE_PRECISION_HINT": "bf16"})
    # int8 by the target's own post-training quantization (OpenVINO: NNCF on the IR), measured on the
    # calibration recordings (engines.calibration) as the ONNX passes that need them are.
    quantize: bool = False


@dataclass(frozen=True)
class Recipe:
    passes: tuple[str, ...] = ()  # for every submodule
    denoiser: tuple[str, ...] | None = None  # replaces `passes` for the denoiser

    def for_submodule(self, entry: dict) -> tuple[str, ...]:
        if self.denoiser is not None and entry.get("quantization", {}).get("denoiser"):
            return self.denoiser
        return self.passes


RECIPES = {
    "fp32": Recipe(),
    "fp16": Recipe(("to_fp16",)),
    # bf16 has fp32's range: no overflow islands. The TensorRT targets read it from the graph's types.
    # ONNX Runtime's CPU has no bf16 MatMul or Conv kernel: the ort target refuses it.
    "bf16": Recipe(("to_bf16",)),
    "fp8": Recipe(("to_fp16",), denoiser=("quantize_fp8",)),
    "int8": Recipe(("quantize_int8",)),
}


def describe_precisions() -> str:
    lines = []
    for name, recipe in RECIPES.items():
        passes = ", ".join(recipe.passes) or "none"
        denoiser = f"; the denoiser: {', '.join(recipe.denoiser)}" if recipe.denoiser is not None else ""
        lines.append(f"precision {name}: passes {passes}{denoiser}")
    return "\n".join(lines)
