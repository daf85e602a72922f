"""fp16 weights and activations by ONNX Runtime's float16 converter, with fp32 islands chosen by
measurement: every node that reads or writes an activation whose calibrated magnitude comes near
fp16's largest value (65504) stays in fp32. T5's feed-forward is the known case on real weights.
The modules a family names in its "fp32_scopes" stay in fp32 too, for precision rather than range:
Flux's sinusoidal timestep and guidance embeddings take arguments up to a few thousand, where fp16's
spacing is 0.5 to 4, so their phases would be wrong (measured on flux-tiny: the images 58 dB from
fp32's with them in fp16, 76 dB without).

A tensor over the limit is then produced and consumed in fp32, never cast to fp16 on the way.
Attention masks are not overflow: "minus infinity" written as float32's lowest value becomes fp16's
lowest, and the softmax still gives those positions zero weight. The graph's inputs and outputs
keep their fp32 types, so the runner feeds and reads the same arrays.
"""
from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import PreconditionError

from engines.passes.base import LibraryPass, Report, Transformed
from engines.passes.infer_shapes import InferShapes

FP16_MAX = 65504.0
# Calibration sees a few dozen prompts: keep 4x headroom for activations larger than those.
RANGE_LIMIT = FP16_MAX / 4
MASK_MAGNITUDE = 1e30  # at float32's limits: a mask value, not an activation


class ToFp16(LibraryPass):
    name = "to_fp16"
    summary = "ONNX Runtime's float16 converter; nodes near fp16's range on calibration inputs stay fp32"
    READS_WEIGHTS = True
    needs_calibration = True

    def call(self, model: ir.Model) -> Report:
        """The converter casts only tensors whose type it knows: every tensor gets one first. ONNX's
        inference types what the fusions added (fuse_attention's reshapes); the contrib ops they made
        (MultiHeadAttention) carry their types already. (ONNX Runtime's symbolic inference, used
        before, raises on a Split whose sizes are symbolic: Flux's text/image split at text_length.)"""
        InferShapes(self.context)(model)
        untyped = [v.name for node in model.graph for v in node.outputs if v.dtype is None]
        if untyped:
            raise PreconditionError(f"to_fp16: {len(untyped)} tensors of {self.context.submodule} have no type after "
                                    f"shape inference (e.g. {', '.join(untyped[:3])}): the pass that made them must type them")
        return super().call(model)

    def transform(self, proto) -> Transformed:
        from onnx import TensorProto
        from onnxruntime.transformers.float16 import convert_float_to_float16

        from engines.passes.ort_tools import activation_ranges, nodes_in_scopes

        ranges = activation_ranges(proto, self.context.calibration)
        scopes = self.context.entry.get("quantization", {}).get("fp32_scopes", ())
        kept = nodes_in_scopes(proto, scopes, {n.op_type for n in proto.graph.node})
        islands = sorted(set(fp32_islands(proto, ranges, RANGE_LIMIT)) | set(kept), key=order(proto))
        nodes_before = len(proto.graph.node)
        out = convert_float_to_float16(proto, keep_io_types=True, disable_shape_infer=True,
                                       node_block_list=islands)
        duplicates = _drop_duplicate_casts(out)
        round_trips = _skip_fp16_round_trips(out)
        out = _cleaned_and_sorted(out)
        casts = len(out.graph.node) - nodes_before
        converted = any(t.type.tensor_type.elem_type == TensorProto.FLOAT16 for t in out.graph.value_info)
        counts = {"fp32_nodes": len(islands), "fp32_by_scope": len(kept), "casts_added": casts, "duplicate_casts_dropped": duplicates,
                  "fp16_round_trips_skipped": round_trips}
        return Transformed(out, modified=converted, counts=counts, details={
            "fp32_islands": islands,
            **({"fp32_scopes": list(scopes)} if scopes else {}),
            "range_limit": RANGE_LIMIT,
            "largest_activation": max((r for r in ranges.values() if r < MASK_MAGNITUDE), default=0.0),
            "calibration_calls": len(self.context.calibration),
        })


def order(proto):
    """Sort key: a node name's place in the graph."""
    place = {n.name: i for i, n in enumerate(proto.graph.node)}
    return place.__getitem__


def fp32_islands(proto, ranges: dict[str, float], limit: float) -> list[str]:
    """Names of the nodes that read or write a tensor whose measured magnitude exceeds `limit`
    (masks aside)."""
    over = {t for t, r in ranges.items() if limit < r < MASK_MAGNITUDE}
    return [n.name for n in proto.graph.node if over & {*n.input, *n.output}]


def _drop_duplicate_casts(proto) -> int:
    """ONNX Runtime's converter before 1.32 gives every fp32 consumer of an fp16 tensor its own Cast
    to fp32, all with the same name and output when two consumers share the tensor (Resize's scales
    in the VAE): keep one. From 1.32 on it emits one shared Cast, and this drops nothing; it stays
    for the older releases pyproject.toml admits."""
    seen, keep = set(), []
    for node in proto.graph.node:
        if node.op_type == "Cast" and node.output[0] in seen:
            continue
        seen.update(node.output)
        keep.append(node)
    dropped = len(proto.graph.node) - len(keep)
    del proto.graph.node[:]
    proto.graph.node.extend(keep)
    return dropped


def _skip_fp16_round_trips(proto) -> int:
    """The converter casts every fp32 node's output to fp16 and back to fp32 for the next fp32 node,
    so a value inside an island would still pass through fp16 (and overflow to inf). Let such
    consumers read the fp32 value itself; the casts left unused are removed afterwards."""
    from onnx import TensorProto

    def cast_to(node):
        return next((a.i for a in node.attribute if a.name == "to"), None) if node.op_type == "Cast" else None

    fp16_from = {n.output[0]: n.input[0] for n in proto.graph.node if cast_to(n) == TensorProto.FLOAT16}
    direct = {n.output[0]: fp16_from[n.input[0]] for n in proto.graph.node
              if cast_to(n) == TensorProto.FLOAT and n.input[0] in fp16_from}
    outputs = {o.name for o in proto.graph.output}
    rewired = 0
    for node in proto.graph.node:
        for i, name in enumerate(node.input):
            if name in direct and name not in outputs:
                node.input[i] = direct[name]
                rewired += 1
    return rewired


def _cleaned_and_sorted(proto):
    """Unused casts removed, and producers before consumers (the converter appends its casts at
    the end of the node list)."""
    import onnx_graphsurgeon as gs

    graph = gs.import_onnx(proto)
    graph.cleanup().toposort()
    return gs.export_onnx(graph)
