"""runners/adapters/quantized.py against the libraries: its fp8 E4M3 rounding against ml_dtypes', and its
per-channel int8 and fp8 quantization against ONNX Runtime's quantizer, the rule the ort-int8 and
ort-fp8 artifacts were built with (an adapter quantizes changed weights again by it)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto
from onnxruntime.quantization.quant_utils import quantize_data

from runners.adapters.quantized import E4M3FN, INT8_CODES, dequantize, quantize, to_e4m3fn


def test_e4m3fn_rounding_is_ml_dtypes():
    rng = np.random.default_rng(0)
    finite = E4M3FN[np.isfinite(E4M3FN)]
    x = np.concatenate([rng.standard_normal(100_000) * 100, finite, (finite[:-1] + finite[1:]) / 2,  # ties
                        [0.0, -0.0, 1e-9, -1e-9, 500.0, -1000.0]]).astype(np.float32)
    expected = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(to_e4m3fn(x).view(np.uint8), expected)
    assert np.array_equal(E4M3FN[expected], np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64),
                          equal_nan=True)


@pytest.mark.parametrize("dtype, onnx_type, codes", [("int8", TensorProto.INT8, INT8_CODES),
                                                     ("int8", TensorProto.INT8, 127),  # artifacts before 7 bits
                                                     ("float8_e4m3fn", TensorProto.FLOAT8E4M3FN, None)])
def test_per_channel_quantization_is_onnx_runtimes(dtype, onnx_type, codes):
    """A (in, out) MatMul weight, per output channel (axis 1), as ONNX Runtime's quantizers do it (int8: with
    reduce_range, as engines/passes/quantize.py builds ort-int8 now, and without, as it did before)."""
    w = (np.random.default_rng(1).standard_normal((48, 6)) * [0.01, 0.1, 1, 3, 20, 0]).astype(np.float32)
    codes_, scale = quantize(w, 1, dtype, **({"codes": codes} if codes else {}))
    assert not dequantize(codes_, scale, 1, dtype)[:, -1].any()  # an all-zero channel (ONNX Runtime's fp8 rule: 0/0)
    for c in range(w.shape[1] - 1):
        _, ref_scale, ref_codes = quantize_data(w[:, c], onnx_type, symmetric=True, reduce_range=codes == INT8_CODES)
        assert np.isclose(scale[c], ref_scale, rtol=1e-6), c
        assert np.array_equal(codes_[:, c].view(np.uint8), np.asarray(ref_codes).view(np.uint8)), c
    back = dequantize(codes_, scale, 1, dtype)
    step = np.abs(w).max(axis=0) / (codes or 8)  # a code's step, at worst
    assert (np.abs(back - w) <= step + 1e-12).all()
