"""Shape inference, done by onnx-ir's `ShapeInferencePass` (ONNX's inference on the graph without
its weights: initializers over 1 KB cross as typed graph inputs, so no weight is copied).

onnx-ir's pass leaves the model unchanged when ONNX's inference fails and only logs it: here that
failure is an error, so that the passes after it never work on a graph they think has shapes. Where
ONNX's inference cannot re-derive a shape the exporter wrote (a Reshape to a computed shape), the
exporter's shape stays: the pass only ever adds information.
"""
from __future__ import annotations

import logging

import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from engines.passes.base import GraphPass, Report


class _Failures(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage() + (f": {record.exc_info[1]}" if record.exc_info else ""))


def _typed(model: ir.Model) -> dict[int, tuple]:
    """(shape, dtype) of every intermediate tensor (the graph's outputs are the runner's contract)."""
    return {id(v): (v.shape, v.dtype) for node in model.graph for v in node.outputs if not v.is_graph_output()}


class InferShapes(GraphPass):
    name = "infer_shapes"
    summary = "onnx-ir: annotate every intermediate tensor with its dtype and (symbolic) shape"

    def call(self, model: ir.Model) -> Report:
        before = _typed(model)
        logger = logging.getLogger("onnx_ir.passes.common.shape_inference")
        failures = _Failures()
        logger.addHandler(failures)
        try:
            ShapeInferencePass()(model)
        finally:
            logger.removeHandler(failures)
        if failures.messages:
            raise RuntimeError(f"ONNX shape inference failed on {self.context.submodule}: {failures.messages[0]}")
        after = _typed(model)
        added = sum(1 for k, (shape, _) in after.items() if shape is not None and before[k][0] is None)
        changed = sum(1 for k in after if after[k] != before[k])
        return Report(model, modified=bool(changed), counts={"shapes_added": added, "shapes_refined": changed - added})
