"""Precision recipes: the passes that turn a target's prepared fp32 graphs into each precision.

Precision lives in the graph (ONNX Runtime, TensorRT and TensorRT-RTX read the same typed ONNX),
so a precision is a list of passes run after the target's own. The denoiser (the submodule run
at every step, named by the export manifest) may take a recipe of its own: fp8 quantizes only it,
and every other submodule runs in fp16. A runtime that takes the precision its own way (OpenVINO:
an inference-precision setting, and NNCF's quantization of its IR) runs none of these passes: the
recipe's `targets` say what it does instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field


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
    # {target: what it does instead}: a target named here runs none of the passes above.
    targets: dict[str, TargetRecipe] = field(default_factory=dict)

    def for_target(self, target: str) -> Recipe:
        """The recipe as `target` runs it: no passes where it takes the precision its own way."""
        return Recipe(targets={target: self.targets[target]}) if target in self.targets else self

    def for_submodule(self, entry: dict) -> tuple[str, ...]:
        if self.denoiser is not None and entry.get("quantization", {}).get("denoiser"):
            return self.denoiser
        return self.passes


def _openvino(hint: str, quantize: bool = False) -> dict[str, TargetRecipe]:
    return {"openvino": TargetRecipe({"INFERENCE_PRECISION_HINT": hint}, quantize)}


RECIPES = {
    "fp32": Recipe(targets=_openvino("f32")),
    "fp16": Recipe(("to_fp16",), targets=_openvino("f16")),  # OpenVINO: for GPU and NPU devices
    # bf16 has fp32's range: no overflow islands. The TensorRT targets read it from the graph's
    # types; OpenVINO takes it as a hint, and its CPU plugin keeps what it needs in fp32 itself.
    # ONNX Runtime's CPU has no bf16 MatMul or Conv kernel: the ort target refuses it.
    "bf16": Recipe(("to_bf16",), targets=_openvino("bf16")),
    "fp8": Recipe(("to_fp16",), denoiser=("quantize_fp8",)),
    # OpenVINO: what NNCF leaves in float runs in bf16, the CPU plugin's own choice where it has bf16.
    "int8": Recipe(("quantize_int8",), targets=_openvino("bf16", quantize=True)),
}


def describe_precisions() -> str:
    lines = []
    for name, recipe in RECIPES.items():
        passes = ", ".join(recipe.passes) or "none"
        denoiser = f"; the denoiser: {', '.join(recipe.denoiser)}" if recipe.denoiser is not None else ""
        own = "".join(f"; {target}: no passes, runtime {', '.join(f'{k}={v}' for k, v in t.runtime.items())}"
                      + (", int8 by its own quantizer" if t.quantize else "")
                      for target, t in recipe.targets.items())
        lines.append(f"precision {name}: passes {passes}{denoiser}{own}")
    return "\n".join(lines)
