"""Quantized weights as ONNX Runtime's quantizers store them (engines/passes/quantize.py), in numpy:
int8 symmetric per channel (W = q * scale, scale = max |W| / 64: 7-bit codes, the record's `codes`; 127 in
artifacts built before 7-bit weights, which record none) and fp8 E4M3 per channel
(W = fp8(q) * scale, scale = std(W) / the std of E4M3's values, saturating at 448). An adapter on a
quantized artifact dequantizes each weight it changes, adds its change, and quantizes the result
again by the quantizer's own rule: the weight scales are computed afresh, the activation scales
(fp8's, calibrated) are kept (runners/adapters/lora.py).

numpy has no fp8 type: fp8 weights are held as their bytes, in the `FLOAT8_E4M3FN` dtype, whose
name says what the bytes are (runners/backends/ort.py hands them to ONNX Runtime as fp8)."""
from __future__ import annotations

import numpy as np

FLOAT8_E4M3FN = np.dtype([("float8_e4m3fn", np.uint8)])
INT8_CODES = 64  # the largest int8 weight code: ONNX Runtime's reduce_range (why: engines/passes/quantize.py)
STORAGE = {"int8": np.dtype(np.int8), "float8_e4m3fn": FLOAT8_E4M3FN}  # a record's dtype -> numpy's


def _e4m3fn_values() -> np.ndarray:
    """The value of each of the 256 codes (sign, 4 exponent bits with bias 7, 3 mantissa bits; no
    infinities, NaN at S.1111.111)."""
    codes = np.arange(256)
    exponent, mantissa = (codes >> 3) & 15, (codes & 7) / 8
    magnitude = np.where(exponent == 0, mantissa * 2.0 ** -6, (1 + mantissa) * 2.0 ** (exponent - 7))
    values = np.where(codes & 128, -magnitude, magnitude)
    values[(codes & 127) == 127] = np.nan
    return values


E4M3FN = _e4m3fn_values()
_FINITE = E4M3FN[np.isfinite(E4M3FN)]


def to_e4m3fn(x: np.ndarray) -> np.ndarray:
    """`x` rounded to the nearest E4M3 value (ties to the even code), saturating at +-448: the codes."""
    magnitude = np.minimum(np.abs(x.astype(np.float64)), 448.0)
    above = np.clip(np.searchsorted(E4M3FN[:127], magnitude), 1, 126)  # first code whose value >= magnitude
    low, high = E4M3FN[above - 1], E4M3FN[above]
    nearer_low = (magnitude - low < high - magnitude) | ((magnitude - low == high - magnitude) & ((above - 1) % 2 == 0))
    code = np.where(magnitude <= 0, 0, np.where(nearer_low, above - 1, above)).astype(np.uint8)
    return np.where(np.signbit(x), code | 128, code).astype(np.uint8).view(FLOAT8_E4M3FN)


def _per_channel(scale: np.ndarray, ndim: int, axis: int) -> np.ndarray:
    shape = [1] * ndim
    shape[axis] = -1
    return scale.reshape(shape)


def dequantize(q: np.ndarray, scale: np.ndarray, axis: int, dtype: str) -> np.ndarray:
    values = E4M3FN[q.view(np.uint8)] if dtype == "float8_e4m3fn" else q
    return (values * _per_channel(scale, q.ndim, axis)).astype(np.float32)


def quantize(w: np.ndarray, axis: int, dtype: str, codes: int = 127) -> tuple[np.ndarray, np.ndarray]:
    """(codes, per-channel float32 scales along `axis`) of `w`, by the quantizer's rule for `dtype` (int8: codes
    -`codes`..`codes`)."""
    others = tuple(a for a in range(w.ndim) if a != axis)
    if dtype == "int8":
        scale = np.abs(w).max(axis=others) / np.float32(codes)
    elif dtype == "float8_e4m3fn":
        scale = w.std(axis=others, dtype=np.float64) / np.std(_FINITE)
    else:
        raise ValueError(f"quantized weights of dtype {dtype}: int8 and float8_e4m3fn are known")
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    x = w / _per_channel(scale, w.ndim, axis)
    if dtype == "int8":
        return np.clip(np.rint(x), -codes, codes).astype(np.int8), scale
    return to_e4m3fn(x), scale
