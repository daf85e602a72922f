"""OpenVINO with compressed weights (`--ov-weights int8` or `int4`), for models whose weights do not
fit in memory once, let alone twice (FLUX.1's 12 B transformer: 24 GB in fp16, on a 24 GiB machine).

NNCF's `compress_weights` (the int8 precision's, for the submodules it does not quantize whole) works
on the OpenVINO model in memory. Here every MatMul's and Gemm's constant weight is compressed on the
ONNX graph before its conversion: the weight is replaced by a DequantizeLinear of two tensors
computed when the graph is written, each weight read, quantized and dropped in turn. OpenVINO's
ONNX reader turns each DequantizeLinear of a constant into its own decompression pattern (Convert,
Multiply, and a Reshape for blocks), which its CPU plugin runs as a FullyConnected over the
compressed weights: the IR and the compiled model hold them compressed.

- int8: symmetric, one scale per output channel (NNCF's INT8_SYM).
- int4: symmetric, one scale per output channel and block of `INT4_BLOCK` inputs (NNCF's INT4_SYM
  with its default group size), ONNX's blocked DequantizeLinear (opset 21). A weight whose input
  width no block of 16 or more divides gets int8.

Why int4 exists: OpenVINO's CPU compile holds a compressed weight twice, memory-mapped from the IR
and repacked, so FLUX.1's 12 GB of int8 weights cannot compile within the scale check's 16 GiB; its
int4 weights do (BENCHMARKS.md, docs/real-sizes.md).
"""
from __future__ import annotations

from math import gcd

import numpy as np
import onnx_ir as ir

from runners.manifest import tensor_values

WEIGHTS = ("int8", "int4")
# Smaller weights are not worth a scale per channel (every real model's linear layers are far larger).
MIN_ELEMENTS = 1024
INT4_BLOCK = 128
MIN_INT4_BLOCK = 16
_LEVELS = {"int8": 127, "int4": 7}
_TYPES = {"int8": ir.DataType.INT8, "int4": ir.DataType.INT4}
BLOCKED_OPSET = 21  # DequantizeLinear's block_size and the int4 type


def _blocks(w: np.ndarray, axis: int, block: int) -> np.ndarray:
    """A view of the float32 weight `w` with its input axis (the one that is not `axis`, the output
    channels') split into (blocks, `block` inputs): (blocks, block, out) for a MatMul's (in, out),
    (out, blocks, block) for a Gemm's (out, in). No copy: a real-size weight is held once."""
    return w.reshape(-1, block, w.shape[1]) if axis == 1 else w.reshape(w.shape[0], -1, block)


def _scale(w: np.ndarray, axis: int, block: int, levels: int) -> np.ndarray:
    """Symmetric scales in DequantizeLinear's blocked layout, (blocks, out) or (out, blocks): each
    block's largest magnitude maps to `levels`."""
    scale = np.abs(_blocks(w, axis, block)).max(axis=1 if axis == 1 else 2) / levels
    scale[scale == 0] = 1
    return scale


def _quantized(w: np.ndarray, axis: int, block: int, levels: int) -> np.ndarray:
    """The integer weight in `w`'s own layout, as int8 values (int4's within -7..7)."""
    scale = _scale(w, axis, block, levels)
    q = _blocks(w, axis, block) / (scale[:, None, :] if axis == 1 else scale[:, :, None])
    np.clip(np.rint(q, out=q), -levels, levels, out=q)
    return q.astype(np.int8).reshape(w.shape)


def _scale_layout(scale: np.ndarray, per_channel: bool) -> np.ndarray:
    """DequantizeLinear's scale: 1-D per output channel (one block), else blocked like the weight."""
    return scale.reshape(-1) if per_channel else scale


def _int4_block(inputs: int) -> int | None:
    block = gcd(inputs, INT4_BLOCK)
    return block if block >= MIN_INT4_BLOCK else None


def compress_weights(model: ir.Model, kind: str = "int8") -> dict[str, int]:
    """Replace the constant 2-D weights of `model`'s MatMuls and Gemms by `kind` ones behind a
    DequantizeLinear, computed when the model is written. Returns how many became each type
    (`kind`'s always, int4's int8 fallbacks where there are any)."""
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
            block = _int4_block(tensor.shape[1 - axis]) if kind == "int4" else None
            replaced[key] = _dequantized(model, node, weight, tensor, axis, block)
        node.replace_input_with(1, replaced[key])
        if not weight.uses() and not weight.is_graph_output():
            model.graph.initializers.pop(weight.name)
    counts = {kind: 0}
    for value in replaced.values():
        stored = value.producer().inputs[0].dtype.name.lower()  # "int4", "int8"
        counts[stored] = counts.get(stored, 0) + 1
    if counts.get("int4"):
        model.opset_imports[""] = max(model.opset_imports.get("", 1), BLOCKED_OPSET)
        model.ir_version = max(model.ir_version or 0, 10)
    return counts


def _dequantized(model: ir.Model, before: ir.Node, weight: ir.Value, tensor, axis: int, block: int | None) -> ir.Value:
    """The DequantizeLinear that stands for `weight`: int4 in blocks of `block` inputs, else int8
    per output channel."""
    kind = "int4" if block else "int8"
    levels, inputs, channels = _LEVELS[kind], tensor.shape[1 - axis], tensor.shape[axis]
    size = block or inputs

    def read():  # each of the two tensors reads the weight once, when it is written
        return tensor_values(tensor).astype(np.float32)

    values = ir.Value(name=f"{weight.name}_{kind}", shape=ir.Shape(tensor.shape), type=ir.TensorType(_TYPES[kind]))
    values.const_value = ir.LazyTensor(lambda: ir.Tensor(_quantized(read(), axis, size, levels), dtype=_TYPES[kind]),
                                       dtype=_TYPES[kind], shape=ir.Shape(tensor.shape), name=values.name)
    scale_shape = [channels] if not block else [inputs // block, channels] if axis == 1 else [channels, inputs // block]
    scale = ir.Value(name=f"{weight.name}_scale", shape=ir.Shape(scale_shape), type=ir.TensorType(tensor.dtype))
    scale.const_value = ir.LazyTensor(
        lambda: ir.tensor(_scale_layout(_scale(read(), axis, size, levels), not block).astype(tensor.dtype.numpy())),
        dtype=tensor.dtype, shape=ir.Shape(scale_shape), name=scale.name)
    model.graph.register_initializer(values)
    model.graph.register_initializer(scale)
    # Blocked, the axis is the blocks' (the inputs'); per channel, the channels'.
    attributes = [ir.AttrInt64("axis", 1 - axis), ir.AttrInt64("block_size", block)] if block else \
        [ir.AttrInt64("axis", axis)]
    node = ir.Node("", "DequantizeLinear", [values, scale], attributes=attributes, name=f"{weight.name}_dequantize")
    node.outputs[0].name, node.outputs[0].dtype = f"{weight.name}_dequantized", tensor.dtype
    node.outputs[0].shape = ir.Shape(tensor.shape)
    model.graph.insert_before(before, node)
    return node.outputs[0]
