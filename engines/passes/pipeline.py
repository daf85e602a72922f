"""A pass pipeline: a list of pass names run in order, each one's report kept.

`PassPipeline(names)` is the lazy form a target holds; `run_passes(model, names)` the eager
one for scripts. A failure says which pass, on which submodule, after which others.
"""
from __future__ import annotations

import time

import onnx_ir as ir

from engines.passes.base import PassContext
from engines.passes.registry import PASSES, check_pass_names
from runners.provenance import initializer_types


class PassFailed(RuntimeError):
    pass


class PassPipeline:
    def __init__(self, names: list[str] | tuple[str, ...]):
        self.names = check_pass_names(names)
        self._passes = [PASSES[n]() for n in self.names]

    @property
    def needs_calibration(self) -> bool:
        return any(p.needs_calibration for p in self._passes)

    def __call__(self, model: ir.Model, submodule: str = "model", log=None,
                 context: PassContext | None = None) -> tuple[ir.Model, list[dict]]:
        context = context or PassContext(submodule)
        reports = []
        for p in self._passes:
            if p.needs_calibration and context.calibration is None:
                raise PassFailed(f"pass '{p.name}' measures the model on calibration inputs, and none were "
                                 f"given for {submodule} (engines.calibration.collect records them)")
            p.context = context
            t0 = time.perf_counter()
            try:
                result = p(model)
            except Exception as e:
                done = ", ".join(r["name"] for r in reports) or "none"
                raise PassFailed(f"pass '{p.name}' failed on {submodule} (passes already run: {done}): "
                                 f"{type(e).__name__}: {e}") from e
            model = result.model
            tracked = context.weights.reconcile(initializer_types(model))
            reports.append({"name": p.name, "modified": result.modified, "counts": result.counts,
                            **({"details": result.details} if getattr(result, "details", None) else {}),
                            "seconds": round(time.perf_counter() - t0, 2), **tracked})
            if log:
                counts = ", ".join(f"{k} {v}" for k, v in result.counts.items()) or "nothing to report"
                log(f"{submodule}: {p.name}: {counts}")
        return model, reports


def run_passes(model: ir.Model, names, submodule: str = "model", log=None,
               context: PassContext | None = None) -> tuple[ir.Model, list[dict]]:
    return PassPipeline(names)(model, submodule, log, context)
