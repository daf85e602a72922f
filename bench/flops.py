"""FLOPs of an exported graph at concrete dims, counted from the graph itself: ONNX Runtime's
symbolic shape inference resolves every shape, then MatMul, Gemm and Conv are counted
(2 FLOPs per multiply-add), and so are the two matmuls inside a fused MultiHeadAttention.
Attention's matmuls are MatMuls in our opset-20 exports, so they are counted too, unlike
torch's FlopCounterMode with the CPU SDPA kernel."""
from __future__ import annotations

import math
from pathlib import Path

import onnx


def _weights_as_inputs(model: onnx.ModelProto, min_elements: int = 4096) -> None:
    """Shape inference needs the weights' shapes, not their values: turn large initializers into
    graph inputs of the same type and shape, so counting a 1.5 GB graph costs kilobytes."""
    graph = model.graph
    large = [i for i in graph.initializer if math.prod(i.dims) >= min_elements]
    for init in large:
        graph.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
        graph.initializer.remove(init)


def _concrete_shapes(model: onnx.ModelProto, dims: dict[str, int]) -> dict[str, list]:
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    _weights_as_inputs(model)
    for value in model.graph.input:
        for d in value.type.tensor_type.shape.dim:
            if d.dim_param in dims:
                d.dim_value = dims[d.dim_param]
    del model.graph.value_info[:]
    inferred = SymbolicShapeInference.infer_shapes(model, auto_merge=True)
    shapes = {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
              for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]}
    shapes.update({i.name: list(i.dims) for i in inferred.graph.initializer})
    return shapes, inferred


def graph_flops_by_op(onnx_path: Path, dims: dict[str, int]) -> dict[str, int]:
    """Multiply-add FLOPs of one call of the graph with the given dynamic dims, by op type."""
    shapes, model = _concrete_shapes(onnx.load(str(onnx_path), load_external_data=False), dims)
    per_op: dict[str, int] = {}
    for node in model.graph.node:
        out = shapes.get(node.output[0])
        if not out or None in out:
            continue
        if node.op_type == "MatMul":
            flops = 2 * math.prod(out) * shapes[node.input[0]][-1]
        elif node.op_type == "Gemm":
            transposed = any(a.name == "transA" and a.i for a in node.attribute)
            a = shapes[node.input[0]]
            flops = 2 * math.prod(out) * (a[0] if transposed else a[1])
        elif node.op_type == "Conv":  # weight (Cout, Cin/groups, kh, kw)
            flops = 2 * math.prod(out) * math.prod(shapes[node.input[1]][1:])
        elif node.op_type == "MultiHeadAttention":  # Q.Kt and P.V over out (B, S, hidden), key length L
            key = shapes[node.input[1]]
            flops = 4 * math.prod(out) * (key[1] if len(key) == 3 else key[2])
        else:
            continue
        per_op[node.op_type] = per_op.get(node.op_type, 0) + flops
    return per_op


def graph_flops(onnx_path: Path, dims: dict[str, int]) -> int:
    """Multiply-add FLOPs of one call of the graph with the given dynamic dims."""
    return sum(graph_flops_by_op(onnx_path, dims).values())
