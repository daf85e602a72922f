"""The machine's fp32 GEMM throughput, measured with each library at hand; the best rate is
the FLOP bound every latency is compared with."""
from __future__ import annotations

import time

import numpy as np

N = 2048  # square fp32 GEMM: 17.2 GFLOP a call, large enough for every library's fast path


def _rate(fn, flops: float, reps: int = 5) -> float:
    fn()  # warm-up: packing, thread pools
    best = min(_time(fn) for _ in range(reps))
    return flops / best / 1e9


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def gemm_gflops(n: int = N) -> dict[str, float]:
    """GFLOP/s per library of an n x n GEMM: numpy's BLAS, torch (MKL), torch's oneDNN, ONNX Runtime (MLAS)."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
    flops = 2.0 * n**3
    rates = {"numpy": _rate(lambda: a @ b, flops)}
    import torch

    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    rates["torch"] = _rate(lambda: torch.mm(ta, tb), flops)
    if torch.backends.mkldnn.is_available():
        ma, wt = ta.to_mkldnn(), tb.t().contiguous().to_mkldnn()
        rates["torch-onednn"] = _rate(lambda: torch._C._nn.mkldnn_linear(ma, wt, None), flops)
    rates["onnxruntime"] = _rate(_ort_matmul(b, a), flops)
    return {k: round(v, 1) for k, v in rates.items()}


def _ort_matmul(b: np.ndarray, a: np.ndarray):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(a.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [a.shape[0], b.shape[1]])],
        [numpy_helper.from_array(b, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    session = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return lambda: session.run(None, {"x": a})
