"""The FLOP counter of the memory analyzer (and the benchmarks), on graphs whose FLOPs are known by hand."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from engines.memory.graph import graph_flops


def test_counts_matmul_gemm_and_conv_at_the_given_dims(tmp_path):
    w = numpy_helper.from_array(np.zeros((8, 16), np.float32), "w")
    g = numpy_helper.from_array(np.zeros((16, 4), np.float32), "g")
    k = numpy_helper.from_array(np.zeros((6, 3, 3, 3), np.float32), "k")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]),                        # (B, T, 8) @ (8, 16)
         helper.make_node("Reshape", ["y", "shape"], ["y2"]),
         helper.make_node("Gemm", ["y2", "g"], ["z"]),                         # (B*T, 16) @ (16, 4)
         helper.make_node("Conv", ["img", "k"], ["c"], pads=[1, 1, 1, 1])],    # 3 -> 6 channels, 3x3, same size
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "tokens", 8]),
         helper.make_tensor_value_info("img", TensorProto.FLOAT, ["batch", 3, "h", "w"])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("c", TensorProto.FLOAT, None)],
        [w, g, k, numpy_helper.from_array(np.array([-1, 16], np.int64), "shape")],
    )
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10), path)
    b, t, h, w_ = 2, 5, 4, 6
    expected = 2 * b * t * 8 * 16 + 2 * b * t * 16 * 4 + 2 * b * 6 * h * w_ * 3 * 3 * 3
    assert graph_flops(path, {"batch": b, "tokens": t, "h": h, "w": w_}) == expected
