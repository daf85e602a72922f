"""OpenVINO with int8 weights (`--ov-weights int8`), for models whose weights do not fit in memory once,
let alone twice (FLUX.1's 12 B transformer: 24 GB in fp16, on a 24 GiB machine).

NNCF's `compress_weights` (the int8 precision's, for the submodules it does not quantize whole) works
on the OpenVINO model in memory. Here every MatMul's and Gemm's constant weight becomes int8 with one
scale per output channel (symmetric, NNCF's INT8_SYM) on the ONNX graph before its conversion: the
weight is replaced by a DequantizeLinear of two tensors computed when the graph is written, each
weight read, quantized and dropped in turn. OpenVINO's ONNX reader turns each DequantizeLinear of a
constant into its own decompression pattern (Convert, Multiply), which its CPU plugin runs as a
FullyConnected over the int8 weights: the IR and the compiled model hold them in int8.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from runners.manifest import tensor_values

WEIGHTS = ("int8",)
# Smaller weights are not worth a scale per channel (every real model's linear layers are far larger).
MIN_ELEMENTS = 1024


def _scale(w: np.ndarray, axis: int) -> np.ndarray:
    """One scale per output channel (the slices along `axis`) of the float32 weight `w`, symmetric:
    the channel's largest magnitude maps to 127."""
    scale = np.abs(w).max(axis=1 - axis) / 127
    scale[scale == 0] = 1
    return scale


def _int8(w: np.ndarray, axis: int) -> np.ndarray:
    return np.clip(np.rint(w / np.expand_dims(_scale(w, axis), 1 - axis)), -127, 127).astype(np.int8)


def compress_weights(model: ir.Model) -> int:
    """Replace the constant 2-D weights of `model`'s MatMuls and Gemms by int8 ones behind a
    DequantizeLinear, computed when the model is written. Returns how many were replaced."""
    replaced = {}
    for node in list(model.graph):
        if node.op_type not in ("MatMul", "Gemm") or len(node.inputs) < 2:
            continue
        weight = node.inputs[1]
        tensor = weight.const_value if weight is not None and weight.is_initializer() else None
        if (tensor is None or len(tensor.shape) != 2 or tensor.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16)
                or tensor.size < MIN_ELEMENTS):
            continue
        trans_b = node.op_type == "Gemm" and node.attributes.get_int("transB", 0)
        axis = 0 if trans_b else 1  # the output channels: B is (in, out), or (out, in) transposed
        key = (weight.name, axis)
        if key not in replaced:
            replaced[key] = _dequantized(model, node, weight, tensor, axis)
        node.replace_input_with(1, replaced[key])
        if not weight.uses() and not weight.is_graph_output():
            model.graph.initializers.pop(weight.name)
    return len(replaced)


def _dequantized(model: ir.Model, before: ir.Node, weight: ir.Value, tensor, axis: int) -> ir.Value:
    def read():  # each of the two tensors reads the weight once, when it is written
        return tensor_values(tensor).astype(np.float32)

    channels = tensor.shape[axis]
    values = ir.Value(name=f"{weight.name}_int8", shape=ir.Shape(tensor.shape), type=ir.TensorType(ir.DataType.INT8))
    values.const_value = ir.LazyTensor(lambda: ir.tensor(_int8(read(), axis)), dtype=ir.DataType.INT8,
                                       shape=ir.Shape(tensor.shape), name=values.name)
    scale = ir.Value(name=f"{weight.name}_scale", shape=ir.Shape([channels]), type=ir.TensorType(tensor.dtype))
    scale.const_value = ir.LazyTensor(lambda: ir.tensor(_scale(read(), axis).astype(tensor.dtype.numpy())),
                                      dtype=tensor.dtype, shape=ir.Shape([channels]), name=scale.name)
    model.graph.register_initializer(values)
    model.graph.register_initializer(scale)
    node = ir.Node("", "DequantizeLinear", [values, scale], attributes=[ir.AttrInt64("axis", axis)],
                   name=f"{weight.name}_dequantize")
    node.outputs[0].name, node.outputs[0].dtype = f"{weight.name}_dequantized", tensor.dtype
    node.outputs[0].shape = ir.Shape(tensor.shape)
    model.graph.insert_before(before, node)
    return node.outputs[0]
