"""A pass pipeline: a list of pass names run in order, each one's report kept.

`PassPipeline(names)` is the lazy form a target holds; `run_passes(model, names)` the eager
one for scripts. Each call makes the passes anew with the submodule's `PassContext`. A failure
says which pass, on which submodule, after which others, and what the libraries said meanwhile.
"""
from __future__ import annotations

import time

import onnx_ir as ir

from engines.passes.base import PassContext
from engines.passes.library_output import library_output
from engines.passes.registry import PASSES, check_pass_names
from runners.adapters.provenance import initializer_types


class PassFailed(RuntimeError):
    pass


class PassPipeline:
    def __init__(self, names: list[str] | tuple[str, ...]):
        self.names = check_pass_names(names)
        self._classes = [PASSES[n] for n in self.names]

    @property
    def needs_calibration(self) -> bool:
        return any(cls.needs_calibration for cls in self._classes)

    def __call__(self, model: ir.Model, submodule: str = "model", log=None,
                 context: PassContext | None = None) -> tuple[ir.Model, list[dict]]:
        context = context or PassContext(submodule)
        reports = []
        for cls in self._classes:
            p = cls(context)
            t0 = time.perf_counter()
            with library_output() as said:
                try:
                    result = p(model)
                except Exception as e:
                    done = ", ".join(r["name"] for r in reports) or "none"
                    libraries = f"\nthe libraries said:\n{said.getvalue().rstrip()}" if said.getvalue().strip() else ""
                    raise PassFailed(f"pass '{p.name}' failed on {submodule} (passes already run: {done}): "
                                     f"{type(e).__name__}: {e}{libraries}") from e
            model = result.model
            tracked = context.weights.reconcile(initializer_types(model))
            reports.append({"name": p.name, "modified": result.modified, "counts": result.counts,
                            **({"details": result.details} if result.details else {}),
                            "seconds": round(time.perf_counter() - t0, 2), **tracked})
            if log:
                counts = ", ".join(f"{k} {v}" for k, v in result.counts.items()) or "nothing to report"
                log(f"{submodule}: {p.name}: {counts}")
        return model, reports


def run_passes(model: ir.Model, names, submodule: str = "model", log=None,
               context: PassContext | None = None) -> tuple[ir.Model, list[dict]]:
    return PassPipeline(names)(model, submodule, log, context)
