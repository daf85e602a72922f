"""Precision recipes: the passes that turn a target's prepared fp32 graphs into each precision.

Precision lives in the graph (ONNX Runtime, TensorRT and TensorRT-RTX read the same typed ONNX),
so a precision is a list of passes run after the target's own. The denoiser (the submodule run
at every step, named by the export manifest) may take a recipe of its own: fp8 quantizes only it,
and every other submodule runs in fp16. A runtime that takes a hint instead of graph types
(OpenVINO's inference precision) gets the hint and no precision passes: the recipe's `hints`.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Recipe:
    passes: tuple[str, ...] = ()  # for every submodule
    denoiser: tuple[str, ...] | None = None  # replaces `passes` for the denoiser
    # {target: runtime settings}: a target named here runs none of the passes above and records
    # these settings for its runtime instead (OpenVINO: {"INFERENCE_PRECISION_HINT": "bf16"}).
    hints: dict[str, dict[str, str]] = field(default_factory=dict)

    def for_target(self, target: str) -> Recipe:
        """The recipe as `target` runs it: only its hints where it takes a hint."""
        return Recipe(hints={target: self.hints[target]}) if target in self.hints else self

    def hint(self, target: str) -> dict[str, str]:
        return dict(self.hints.get(target, {}))

    def for_submodule(self, entry: dict) -> tuple[str, ...]:
        if self.denoiser is not None and entry.get("quantization", {}).get("denoiser"):
            return self.denoiser
        return self.passes


def _openvino(hint: str) -> dict[str, dict[str, str]]:
    return {"openvino": {"INFERENCE_PRECISION_HINT": hint}}


RECIPES = {
    "fp32": Recipe(hints=_openvino("f32")),
    "fp16": Recipe(("to_fp16",), hints=_openvino("f16")),  # OpenVINO: for GPU and NPU devices
    # bf16 has fp32's range: no overflow islands. Only OpenVINO takes it for now (ONNX Runtime's
    # CPU has no bf16 MatMul or Conv kernel); its CPU plugin keeps what it needs in fp32 itself.
    "bf16": Recipe(hints=_openvino("bf16")),
    "fp8": Recipe(("to_fp16",), denoiser=("quantize_fp8",)),
    "int8": Recipe(("quantize_int8",)),
}


def describe_precisions() -> str:
    lines = []
    for name, recipe in RECIPES.items():
        passes = ", ".join(recipe.passes) or "none"
        denoiser = f"; the denoiser: {', '.join(recipe.denoiser)}" if recipe.denoiser is not None else ""
        hints = "".join(f"; {target}: no passes, runtime {', '.join(f'{k}={v}' for k, v in hint.items())}"
                        for target, hint in recipe.hints.items())
        lines.append(f"precision {name}: passes {passes}{denoiser}{hints}")
    return "\n".join(lines)
