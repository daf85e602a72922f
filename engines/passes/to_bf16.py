"""bf16 weights and activations: a strongly typed bfloat16 graph, for the TensorRT targets (whose
networks take their precision from the graph's types).

bf16 has fp32's range, so nothing is kept for overflow (fp16's islands). What stays in fp32 is
what needs fp32 accumulation for accuracy: the normalizations' statistics (ReduceMean of the RMS
norms, InstanceNormalization of the VAE's group norms) and Softmax; LayerNormalization computes
its statistics in fp32 by the ONNX spec (`stash_type`). Inputs that ONNX types as float whatever
the data type (Resize's scales) stay float. The graph's inputs and outputs keep their fp32 types,
so the runner feeds and reads the same arrays.
"""
from __future__ import annotations

import onnx_ir as ir

from engines.passes.base import GraphPass, Report

FLOAT, BF16 = ir.DataType.FLOAT, ir.DataType.BFLOAT16
FP32_OPS = ("ReduceMean", "InstanceNormalization", "Softmax")
# (op type, input index) whose type ONNX fixes to float whatever the data's type.
FLOAT_INPUTS = {("Resize", 2)}


def _bf16_tensor(tensor) -> ir.Tensor:
    import ml_dtypes

    return ir.Tensor(tensor.numpy().astype(ml_dtypes.bfloat16), name=tensor.name)


class ToBf16(GraphPass):
    name = "to_bf16"
    summary = "every float32 weight and activation in bfloat16; norm statistics and Softmax stay fp32"

    def call(self, model: ir.Model) -> Report:
        graph = model.graph
        fixed = {node.inputs[i] for node in graph for op, i in FLOAT_INPUTS
                 if node.op_type == op and len(node.inputs) > i and node.inputs[i] is not None}
        weights = 0
        for value in graph.initializers.values():
            if value.dtype == FLOAT and value not in fixed:
                value.const_value = _bf16_tensor(value.const_value)
                value.dtype = BF16
                weights += 1
        constants = 0
        for node in graph:
            if node.op_type in ("Constant", "ConstantOfShape") and "value" in node.attributes:
                attr = node.attributes["value"]
                if attr.value.dtype == FLOAT and node.outputs[0] not in fixed:
                    node.attributes["value"] = ir.AttrTensor("value", _bf16_tensor(attr.value))
                    constants += 1
            elif node.op_type == "Cast" and node.attributes["to"].value == FLOAT and node.outputs[0] not in fixed:
                node.attributes["to"] = ir.AttrInt64("to", BF16)
        activations = 0
        for node in list(graph):
            for out in node.outputs:
                if out.dtype == FLOAT and out not in fixed:
                    out.dtype = BF16
                    activations += 1
        kept = [node for node in list(graph) if node.op_type in FP32_OPS]
        for node in kept:
            self._keep_fp32(graph, node)
        inputs = [v for v in graph.inputs if v.dtype == FLOAT]
        for value in inputs:
            self._cast_input(graph, value)
        outputs = [i for i, v in enumerate(graph.outputs) if v.dtype == BF16]
        for i in outputs:
            self._cast_output(graph, i)
        counts = {"weights_bf16": weights, "constants_bf16": constants, "activations_bf16": activations,
                  "fp32_nodes": len(kept), "io_casts": len(inputs) + len(outputs)}
        return Report(model, modified=bool(weights or constants or activations), counts=counts)

    @staticmethod
    def _keep_fp32(graph, node) -> None:
        """`node` reads fp32 copies of its bf16 inputs and writes fp32, cast back for its readers."""
        for i, value in enumerate(node.inputs):
            if value is not None and value.dtype == BF16:
                cast = ir.node("Cast", [value], {"to": FLOAT}, name=f"{node.name}/to_fp32_{i}")
                cast.outputs[0].dtype = FLOAT
                graph.insert_before(node, cast)
                node.replace_input_with(i, cast.outputs[0])
        for out in node.outputs:
            if out.dtype == BF16:
                readers = list(out.uses())
                out.dtype = FLOAT
                cast = ir.node("Cast", [out], {"to": BF16}, name=f"{node.name}/to_bf16")
                cast.outputs[0].dtype = BF16
                graph.insert_after(node, cast)
                for reader, index in readers:  # a graph output stays this fp32 value
                    reader.replace_input_with(index, cast.outputs[0])

    @staticmethod
    def _cast_input(graph, value) -> None:
        """The graph's float32 input stays; its readers read a bf16 copy."""
        readers = list(value.uses())
        cast = ir.node("Cast", [value], {"to": BF16}, name=f"{value.name}/to_bf16")
        cast.outputs[0].dtype = BF16
        graph.insert_before(graph.node(0), cast)
        for reader, index in readers:
            reader.replace_input_with(index, cast.outputs[0])

    @staticmethod
    def _cast_output(graph, i: int) -> None:
        """Graph output `i` becomes a float32 cast of its bf16 value, under the same name."""
        value = graph.outputs[i]
        cast = ir.node("Cast", [value], {"to": FLOAT}, name=f"{value.name}/to_fp32")
        out = cast.outputs[0]
        out.dtype, out.shape = FLOAT, value.shape
        graph.append(cast)
        name = value.name
        value.name = f"{name}_bf16"
        out.name = name
        graph.outputs[i] = out
