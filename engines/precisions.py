"""Precision recipes: the passes that turn a target's prepared fp32 graphs into each precision.

Precision lives in the graph (ONNX Runtime, TensorRT and TensorRT-RTX read the same typed ONNX),
so a precision is a list of passes run after the target's own. The denoiser (the submodule run
at every step, named by the export manifest) may take a recipe of its own: fp8 quantizes only it,
and every other submodule runs in fp16.
"""
from __future__ import annotations

from dataclasses import dataclass


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
