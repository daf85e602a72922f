"""Quantized linear layers by ONNX Runtime's quantization tools: int8 for CPUs (dynamic W8A8,
for its VNNI kernels) and fp8 E4M3 as QuantizeLinear/DequantizeLinear pairs for GPUs (per-channel
weight scales, per-tensor activation scales calibrated on the pipeline's own activations).

Layers under the submodule's `keep_scopes` (from the export manifest: for SD3's transformer the
embedders and the final norm and projection, as NVIDIA's recipe keeps them) stay in float.
"""
from __future__ import annotations

import contextlib
import json
import logging
from collections import Counter

from onnx import TensorProto

from engines.passes.base import LibraryPass, Transformed
from engines.passes.ort_tools import SESSION_CONFIG_KEY, load_model, model_file, nodes_in_scopes
from runners.adapters.quantized import INT8_CODES

LINEAR_OPS = ["MatMul"]


def _select(proto, context) -> tuple[list[str], list[str]]:
    """(layers to quantize, layers kept in float): the MatMuls with a constant weight, minus those
    under the submodule's keep_scopes.

    Gemms stay in float: in these graphs they multiply per-sample vectors (timestep and pooled-text
    embeddings, adaLN modulation), a negligible share of the FLOPs, and fuse_qkv merges the adaLN
    Gemms that read one embedding, the final norm's included. The list is passed to the tools as
    `nodes_to_quantize`, as quantize_dynamic renames a Gemm to a MatMul before it reads exclusions."""
    weights = {i.name for i in proto.graph.initializer}
    linear = [n.name for n in proto.graph.node if n.op_type in LINEAR_OPS and n.input[1] in weights]
    kept = set(nodes_in_scopes(proto, context.entry.get("quantization", {}).get("keep_scopes", ()), LINEAR_OPS))
    return [n for n in linear if n not in kept], [n for n in linear if n in kept]


def _record_quantized(table, proto) -> None:
    """ONNX Runtime's quantizers replace a weight W by W_quantized, with W_scale and W_zero_point:
    its provenance follows it and names them. The channel axis is the DequantizeLinear's (the fp8
    Q/DQ pairs); MatMulInteger's weights (int8) are per output channel, axis 1 of (in, out). W_scale
    is tracked too (a record without parts: it holds no parameter), so that it is saved where an
    adapter reaches it, and replaced with the weight (runners/adapters/quantized.py)."""
    from onnx import helper

    initializers = {i.name: i for i in proto.graph.initializer}
    axes = {n.input[0]: next((a.i for a in n.attribute if a.name == "axis"), 1)
            for n in proto.graph.node if n.op_type == "DequantizeLinear"}
    for name in [n for n in table if n not in initializers and f"{n}_quantized" in initializers]:
        quantized, scale = f"{name}_quantized", initializers[f"{name}_scale"]
        table[quantized] = {**table.pop(name), "quantized": {
            "scale": scale.name, "zero_point": f"{name}_zero_point", "axis": axes.get(quantized, 1),
            **({"codes": INT8_CODES} if initializers[quantized].data_type == TensorProto.INT8 else {})}}
        table[scale.name] = {"dtype": helper.tensor_dtype_to_np_dtype(scale.data_type).name,
                             "shape": list(scale.dims), "parts": [], "scale_of": quantized}


@contextlib.contextmanager
def _quiet_root_logger():
    """The quantizers warn on the root logger, at every call, that the model did not go through
    their pre-processing script (symbolic shape inference and ONNX Runtime's optimizer, which the
    session applies at load time anyway)."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


class QuantizeInt8(LibraryPass):
    name = "quantize_int8"
    summary = "ONNX Runtime quantize_dynamic: int8 weights per channel, uint8 activations per call"
    READS_WEIGHTS = True

    def transform(self, proto) -> Transformed:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        chosen, kept = _select(proto, self.context)
        if not chosen:  # the tools read an empty list as "quantize every node"
            return Transformed(proto, False, {"linear_int8": 0, "linear_kept_float": len(kept)}, {"kept_float": kept})
        # quantize_dynamic re-runs ONNX shape inference, which rejects a shape recorded in the value_info
        # of our graphs (sd3-tiny's transformer: 80 vs 32); without value_info it infers them afresh.
        del proto.graph.value_info[:]
        with model_file(proto) as (path, folder), _quiet_root_logger():
            # reduce_range: weights on 7 bits (codes -64..64). Without VNNI (AVX2), ONNX Runtime's u8 x s8 kernel sums
            # pairs of products in int16, which full-range weights overflow: sd3-tiny's images were 29 to 32 dB from
            # fp32's on a Zen 3, and are 48 to 60 dB with this; where the sums are exact (VNNI, AMX) the bit costs
            # 1 to 4 dB (51.5 to 61.7 dB before). An artifact does not know the CPU it will run on.
            quantize_dynamic(path, folder / "int8.onnx", op_types_to_quantize=LINEAR_OPS, per_channel=True,
                             weight_type=QuantType.QInt8, reduce_range=True, nodes_to_quantize=chosen,
                             use_external_data_format=True,
                             # contrib ops (MultiHeadAttention) have no ONNX type inference: their outputs are float
                             extra_options={"DefaultTensorType": TensorProto.FLOAT})
            out = load_model(folder / "int8.onnx")
        _record_quantized(self.context.weights, out)
        ops = Counter(n.op_type for n in out.graph.node)
        return Transformed(out, modified=bool(ops["MatMulInteger"]),
                           counts={"linear_int8": ops["MatMulInteger"], "linear_kept_float": len(kept)},
                           details={"kept_float": kept})


class QuantizeFp8(LibraryPass):
    name = "quantize_fp8"
    summary = "ONNX Runtime quantize_static: fp8 E4M3 Q/DQ on linear layers, scales calibrated on the pipeline"
    READS_WEIGHTS = True
    needs_calibration = True
    # ONNX Runtime's CPU QDQ fusions handle int8 only: the fp8 pairs must run unfused. Before 1.32 it
    # refuses the graph at its default optimization level without this; 1.32 leaves fp8 pairs unfused
    # by itself and computes the same bits with or without it. An artifact may be run by an older
    # onnxruntime than the one that built it (pyproject.toml admits >= 1.22), so the manifest keeps it.
    SESSION_CONFIG = {"session.disable_quant_qdq": "1"}

    def transform(self, proto) -> Transformed:
        from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

        chosen, kept = _select(proto, self.context)
        if not chosen:  # the tools read an empty list as "quantize every node"
            return Transformed(proto, False, {"linear_fp8": 0, "linear_kept_float": len(kept)}, {"kept_float": kept})
        feeds = self.context.calibration
        with model_file(proto) as (path, folder), _quiet_root_logger():
            quantize_static(path, folder / "fp8.onnx", feeds.reader(), quant_format=QuantFormat.QDQ,
                            activation_type=QuantType.QFLOAT8E4M3FN, weight_type=QuantType.QFLOAT8E4M3FN,
                            per_channel=True, op_types_to_quantize=LINEAR_OPS, nodes_to_quantize=chosen,
                            use_external_data_format=True,
                            # float8 needs the distribution calibrator; without QDQKeepRemovableActivations
                            # the quantizer silently drops activations it deems removable (Relu).
                            calibrate_method=CalibrationMethod.Distribution,
                            # The distribution calibrator keeps every activation of the calls it has read
                            # (all of a calibration run's transformer calls would not fit): a few at a time.
                            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True,
                                           "QDQKeepRemovableActivations": True,
                                           "CalibStridedMinMax": feeds.chunk()})
            out = load_model(folder / "fp8.onnx")
        _record_quantized(self.context.weights, out)
        entry = out.metadata_props.add()
        entry.key, entry.value = SESSION_CONFIG_KEY, json.dumps(self.SESSION_CONFIG)
        ops = Counter(n.op_type for n in out.graph.node)
        producer = {o: n.op_type for n in out.graph.node for o in n.output}
        quantized = sum(1 for n in out.graph.node if n.op_type in LINEAR_OPS
                        and all(producer.get(i) == "DequantizeLinear" for i in n.input[:2]))
        counts = {"linear_fp8": quantized, "linear_kept_float": len(kept),
                  "quantize_nodes": ops["QuantizeLinear"], "dequantize_nodes": ops["DequantizeLinear"]}
        return Transformed(out, modified=bool(quantized), counts=counts,
                           details={"kept_float": kept, "calibration_calls": len(feeds)})

