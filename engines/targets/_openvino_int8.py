"""OpenVINO int8: NNCF's post-training quantization of the IR, measured on the pipeline's own
calibration recordings (engines.calibration), so that the CPU's VNNI/AMX units run it.

Which submodule gets what is data from the export manifest's `quantization` entry:
- the denoiser ("denoiser") and "activations" (the VAE decoder, where the end-to-end time goes once
  the denoiser is fast): weights and activations, NNCF's transformer scheme (it smooths activation
  outliers into the weights). The linear layers under "keep_scopes" stay in float, and so do the
  Gemms, as in ONNX Runtime's int8 (engines.passes.quantize);
- the others (text encoders, VAE encoder): int8 weights, computed in float. Run once per image,
  they gain little from int8 arithmetic; their weights are what costs (memory, load time).
"""
from __future__ import annotations

import re
from collections import Counter

from engines.passes.ort_tools import in_scopes

# NNCF's statistics cost one pass of Python reductions per recorded call (92 s of sd15-tiny's 145 s
# quantization for its 416 calls): it reads at most this many, spread evenly over the recording so
# that every prompt and step is represented.
CALIBRATION_CALLS = 128


def spread(count: int, most: int = CALIBRATION_CALLS) -> list[int]:
    """Indices of at most `most` of `count` recorded calls, evenly spaced from the first."""
    return [i * count // most for i in range(most)] if count > most else list(range(count))


def _kept_float(model, entry: dict) -> list[str]:
    """Names of the onnx-ir `model`'s linear nodes that stay in float: the Gemms and the MatMuls under
    the entry's keep_scopes. OpenVINO names a node after the ONNX node it comes from (a Gemm's
    MatMul is `<gemm>/WithoutBiases`)."""
    scopes = entry.get("quantization", {}).get("keep_scopes", ())
    return sorted(n.name for n in model.graph.all_nodes()
                  if n.op_type == "Gemm" or (n.op_type == "MatMul" and in_scopes(n.metadata_props, scopes)))


def quantize(ov_model, onnx_model, entry: dict, feeds) -> tuple[object, dict, dict]:
    """(int8 OpenVINO model, counts, details) of `ov_model`, read from `onnx_model` (onnx-ir)."""
    import nncf

    role = entry.get("quantization", {})
    if role.get("denoiser") or role.get("activations"):
        kept = _kept_float(onnx_model, entry)
        scope = nncf.IgnoredScope(patterns=[f"^{re.escape(name)}(/WithoutBiases)?$" for name in kept], validate=False)
        # The transformer scheme on the VAE too: in a one-off comparison on sd3-tiny its smoothing kept
        # the images closer to fp32's than NNCF's default scheme. test_openvino holds the result to a bound.
        calls = spread(len(feeds))
        # Every layer's weights on 7 bits (NNCF's overflow fix; its default fixes the first layer only). A CPU
        # without VNNI (AVX2: Zen 3, Intel client cores before Ice Lake) sums pairs of u8 x s8 products in int16,
        # which 8-bit weights overflow: qwen-image-2.1-tiny's images fell from 45 dB to 27 dB on a Zen 3. The
        # eighth bit costs 0.2 to 0.4 dB where the arithmetic is exact (VNNI, AMX: measured on that Zen 3 with
        # FakeQuantize run in float), and the artifact does not know the CPU it will run on.
        fix = nncf.AdvancedQuantizationParameters(overflow_fix=nncf.OverflowFix.ENABLE)
        ov_model = nncf.quantize(ov_model, nncf.Dataset(calls, feeds.__getitem__), subset_size=len(calls),
                                 ignored_scope=scope, model_type=nncf.ModelType.TRANSFORMER, advanced_parameters=fix)
        ops = Counter(op.get_type_name() for op in ov_model.get_ops())
        return ov_model, {"fake_quantize": ops["FakeQuantize"], "linear_kept_float": len(kept)}, {
            "scheme": "weights and activations", "kept_float": kept, "calibration_calls": len(calls),
            "calls_recorded": len(feeds)}
    ov_model = nncf.compress_weights(ov_model)  # int8 weights, asymmetric per channel
    int8 = sum(1 for op in ov_model.get_ops()
               if op.get_type_name() == "Constant" and op.get_element_type().get_type_name() in ("u8", "i8"))
    return ov_model, {"int8_weights": int8}, {"scheme": "weights"}
