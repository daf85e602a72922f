"""Where an adapter reaches an OpenVINO IR: for every tracked weight that a linear layer reads (ONNX
MatMul or Gemm), the IR node whose input is that layer's activation and the node whose output the
layer's result is, recorded in the weight table (`record["openvino"]`) at build time.

OpenVINO's reader folds and renames the weights themselves (a Gemm's transposed weight becomes a new
constant, NNCF's int8 replaces it by a dequantization), so the IR's constants cannot be found by the
ONNX initializer names; its nodes keep the ONNX nodes' names (a Gemm is `<gemm>/WithoutBiases`, a
MatMul, then the bias Add named `<gemm>`). The runner adds each adapter as a low-rank branch beside
that layer (runners/backends/_openvino_lora.py), leaving the base weights, int8 ones too, as built.
"""
from __future__ import annotations


def record_layers(onnx_model, ov_model, table) -> int:
    """Record each linear layer's IR nodes in `table` (onnx-ir model, OpenVINO model of it). Each
    record gets `openvino: [{"matmul", "output", "x", "x_port", "transposed", "x_transposed"}]`: the
    IR MatMul, the node whose output is the layer's (the bias Add of a Gemm), the node output that is
    the layer's float activation (`activation`), whether the layer multiplies by the weight's
    transpose (Gemm transB), and whether the IR MatMul reads the activation transposed (OpenVINO's
    reader folds a Transpose before it into `transpose_a`). Returns how many layers were recorded."""
    ops = {op.get_friendly_name(): op for op in ov_model.get_ops()}
    for record in table.values():
        record.pop("openvino", None)
    count = 0
    for node in onnx_model.graph.all_nodes():
        if node.op_type not in ("MatMul", "Gemm") or len(node.inputs) < 2 or node.inputs[1] is None:
            continue
        weight = node.inputs[1].name
        if weight not in table or len(table[weight]["shape"]) != 2:
            continue
        attrs = node.attributes
        if node.op_type == "Gemm" and (attrs.get("transA") is not None and attrs["transA"].value):
            continue
        matmul = ops.get(node.name if node.op_type == "MatMul" else f"{node.name}/WithoutBiases")
        output = ops.get(node.name)
        if matmul is None or matmul.get_type_name() != "MatMul" or output is None:
            continue
        transposed = node.op_type == "Gemm" and attrs.get("transB") is not None and bool(attrs["transB"].value)
        table[weight].setdefault("openvino", []).append(
            {"matmul": matmul.get_friendly_name(), "output": output.get_friendly_name(), **activation(matmul),
             "transposed": transposed, "x_transposed": bool(matmul.get_attributes()["transpose_a"])})
        count += 1
    return count


def activation(matmul) -> dict:
    """{"x": node, "x_port": output} of the layer's activation as the model computes it: before NNCF's
    int8 activation quantizer (FakeQuantize) and its SmoothQuant scale (a Multiply named
    `.../nncf_smooth_quant`, whose scale NNCF folded into the weight), so that a branch reads what
    the layer's float weight would have read."""
    x = matmul.input(0).get_source_output()
    while (x.get_node().get_type_name() == "FakeQuantize"
           or x.get_node().get_friendly_name().endswith("/nncf_smooth_quant")):
        x = x.get_node().input(0).get_source_output()
    return {"x": x.get_node().get_friendly_name(), "x_port": x.get_index()}
