"""Export one submodule to ONNX with the dynamo exporter, name its dynamic axes, and prove it
against PyTorch in ONNX Runtime at two shapes before it counts as done."""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from export.shapes import concrete
from export.spec import SubmoduleSpec

DEFAULT_OPSET = 20  # MatMul/Softmax attention: builds on every target (opset 23's Attention does not)
# fp32 export parity: observed ~1e-6; the bound leaves room for summation-order noise only.
PARITY_RTOL = 1e-4


class ExportParityError(RuntimeError):
    pass


@dataclass
class ParityResult:
    dims: dict
    max_abs_err: float
    max_abs_ref: float

    @property
    def ok(self) -> bool:
        return self.max_abs_err <= PARITY_RTOL * max(1.0, self.max_abs_ref)


def example_inputs(spec: SubmoduleSpec, dims: dict, constants: dict, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = []
    for t in spec.inputs:
        shape = concrete(t.shape, dims, constants)
        high = constants[t.high] if isinstance(t.high, str) else t.high
        if t.dtype.startswith("int"):
            arrays.append(rng.integers(0, high, size=shape, dtype=t.dtype))
        elif high is not None:
            arrays.append(rng.uniform(0, high, size=shape).astype(t.dtype))
        else:
            arrays.append(rng.standard_normal(shape, dtype=np.float32).astype(t.dtype))
    return arrays


def _dynamic_shapes(spec: SubmoduleSpec, dynamic: set[str]) -> dict:
    # Dim.AUTO lets torch.export infer the relations (even latent sides, ...); the symbols it
    # picks are renamed to our dimension names afterwards.
    return {
        t.name: {i: torch.export.Dim.AUTO for i, d in enumerate(t.shape) if d in dynamic}
        for t in spec.inputs
    }


def _name_axes(model, spec: SubmoduleSpec, dynamic: set[str]) -> None:
    """Give graph inputs/outputs our dimension names, and rename the exporter's symbols
    (s0, s12, 2*((s12//2)) ...) everywhere else, so every stage sees 'batch', 'latent_height'."""
    import onnx_ir as ir

    symbols: dict[str, str] = {}
    for value, t in zip(model.graph.inputs, spec.inputs):
        for dim, name in zip(value.shape, t.shape):
            if isinstance(name, str) and name in dynamic and isinstance(dim, ir.SymbolicDim) and dim.value:
                symbols.setdefault(dim.value, name)
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, symbols)) + r")\b") if symbols else None

    def rename(shape):
        if shape is None or pattern is None:
            return shape
        return ir.Shape([ir.SymbolicDim(pattern.sub(lambda m: symbols[m.group(1)], d.value))
                         if isinstance(d, ir.SymbolicDim) and d.value else d for d in shape])

    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for value in node.outputs:
            value.shape = rename(value.shape)
    for values, specs in ((model.graph.inputs, spec.inputs), (model.graph.outputs, spec.outputs)):
        for value, t in zip(values, specs):
            value.shape = ir.Shape([d if isinstance(d, int) else (d if d in dynamic else old)
                                    for d, old in zip(t.shape, value.shape)])


def export_submodule(
    spec: SubmoduleSpec, module: torch.nn.Module, constants: dict, dynamic: set[str],
    probes: list[dict], out_path: Path, opset: int = DEFAULT_OPSET,
) -> dict:
    """Export `module` (already wrapped) to `out_path` and check it; returns the report."""
    t0 = time.perf_counter()
    example = [torch.from_numpy(a) for a in example_inputs(spec, probes[0], constants, seed=0)]
    with torch.no_grad():
        program = torch.onnx.export(
            module, tuple(example), dynamo=True, opset_version=opset,
            input_names=[t.name for t in spec.inputs], output_names=[t.name for t in spec.outputs],
            dynamic_shapes=_dynamic_shapes(spec, dynamic), verbose=False,
        )
    _name_axes(program.model, spec, dynamic)
    program.save(out_path)
    export_seconds = time.perf_counter() - t0
    parity = check_parity(spec, module, constants, probes, out_path)
    bad = [p for p in parity if not p.ok]
    if bad:
        raise ExportParityError(
            f"{spec.name}: ONNX Runtime differs from PyTorch by {bad[0].max_abs_err:.3g} at {bad[0].dims} "
            f"(allowed {PARITY_RTOL:g} x max(1, |reference| = {bad[0].max_abs_ref:.3g}))"
        )
    files = [out_path] + [p for p in out_path.parent.glob(out_path.name + ".data")]
    return {
        "export_seconds": round(export_seconds, 2),
        "bytes": sum(f.stat().st_size for f in files),
        "opset": opset,
        "parity": [{"dims": p.dims, "max_abs_err": p.max_abs_err, "max_abs_ref": p.max_abs_ref} for p in parity],
    }


def check_parity(spec, module, constants, probes, onnx_path) -> list[ParityResult]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    results = []
    for i, dims in enumerate(probes):
        inputs = example_inputs(spec, dims, constants, seed=100 + i)
        with torch.no_grad():
            ref = module(*[torch.from_numpy(a) for a in inputs])
        got = session.run(None, {t.name: a for t, a in zip(spec.inputs, inputs)})
        err = max(float(np.max(np.abs(g - r.numpy()))) for g, r in zip(got, ref))
        scale = max(float(np.max(np.abs(r.numpy()))) for r in ref)
        used = {k: v for k, v in dims.items() if any(k in t.shape for t in spec.inputs + spec.outputs)}
        results.append(ParityResult(used, err, scale))
    return results
