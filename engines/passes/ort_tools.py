"""What the precision passes share: ONNX Runtime's quantization tools read and write model files,
and its calibrator measures activations by running the model on calibration inputs."""
from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import numpy as np


@contextlib.contextmanager
def model_file(proto):
    """`proto` saved in a temporary folder (weights as external data, so any size works); yields
    (path, folder) and removes both afterwards."""
    import onnx

    with tempfile.TemporaryDirectory(prefix="diffusion-aot-") as folder:
        path = Path(folder) / "model.onnx"
        onnx.save_model(proto, path, save_as_external_data=True, all_tensors_to_one_file=True,
                        location="model.onnx.data", size_threshold=1024)
        # Saving moved the weights out of `proto` into the file: read them back, so the caller's
        # model stays whole after the folder is gone.
        onnx.load_external_data_for_model(proto, str(folder))
        yield path, Path(folder)


def load_model(path: Path):
    """A model written by a tool, with its weights read into memory before the folder goes."""
    import onnx

    return onnx.load(path, load_external_data=True)


def infer_symbolic_shapes(proto, **options):
    """ONNX Runtime's symbolic shape inference. On a graph it cannot complete, it writes a debug
    model into the working directory before it raises: it runs in a temporary one, so that nothing
    is left behind."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    with tempfile.TemporaryDirectory(prefix="diffusion-aot-") as folder, contextlib.chdir(folder):
        return SymbolicShapeInference.infer_shapes(proto, **options)


def activation_ranges(proto, feeds) -> dict[str, float]:
    """{tensor: largest absolute value} for every float tensor a node reads or writes (weights aside), over
    all `feeds` (an engines.calibration.CalibrationFeeds): the graph, with an Abs and a ReduceMax of each
    such tensor added as outputs, run by ONNX Runtime on every call, unoptimized so that every tensor is
    the graph's own. (ONNX Runtime's min-max calibrator measures the same, but adds its nodes in quadratic
    time: 22 of the 47 s that to_fp16 took on sd15-tiny's U-Net.)"""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    typed = {v.name: v.type.tensor_type.elem_type
             for v in (*proto.graph.value_info, *proto.graph.input, *proto.graph.output)}
    weights = {t.name for t in proto.graph.initializer}
    tensors = sorted({name for node in proto.graph.node for name in (*node.input, *node.output)
                      if typed.get(name) in (TensorProto.FLOAT, TensorProto.FLOAT16) and name not in weights})
    with model_file(proto) as (path, folder):
        augmented = onnx.load(path, load_external_data=False)  # the weights stay in the file beside it
        names = [f"diffusion_aot.range.{i}" for i in range(len(tensors))]  # a namespace no exporter uses
        for name, out in zip(tensors, names):
            augmented.graph.node.extend([
                helper.make_node("Abs", [name], [f"{out}.abs"], name=f"{out}.abs"),
                # keepdims: ONNX Runtime cannot reduce an empty axis away
                helper.make_node("ReduceMax", [f"{out}.abs"], [out], name=out, keepdims=1)])
            augmented.graph.output.append(helper.make_tensor_value_info(out, typed[name], None))
        onnx.save(augmented, folder / "augmented.onnx")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(str(folder / "augmented.onnx"), options, providers=["CPUExecutionProvider"])
        largest = np.zeros(len(tensors))
        for feed in feeds:
            ranges = session.run(names, feed)
            largest = np.maximum(largest, [float(r.max()) if r.size else 0.0 for r in ranges])
        del session
    return dict(zip(tensors, largest.tolist()))


# Model metadata through which a pass tells the ORT target and runner which session config entries
# its graph needs (recorded per submodule in the artifact manifest as "session_config").
SESSION_CONFIG_KEY = "diffusion_aot.ort_session_config"
# The same for session options that are not config entries (execution order, arena, buffer reuse,
# optimizers to disable): recorded as "session_options", applied by runners.backends.ort.
SESSION_OPTIONS_KEY = "diffusion_aot.ort_session_options"


def request_session_options(model, **options) -> None:
    """Ask, through an onnx-ir model's metadata, for ONNX Runtime session options (merged with
    what earlier passes asked; lists such as disabled_optimizers are joined)."""
    import json

    current = json.loads(model.metadata_props.get(SESSION_OPTIONS_KEY, "{}"))
    for key, value in options.items():
        current[key] = sorted(set(current.get(key, [])) | set(value)) if isinstance(value, list) else value
    model.metadata_props[SESSION_OPTIONS_KEY] = json.dumps(current, sort_keys=True)


NAME_SCOPES_KEY = "pkg.torch.onnx.name_scopes"  # the exporter's module path of every node


def in_scopes(metadata, scopes) -> bool:
    """Whether a node with this metadata was exported from a module whose dotted path has one of
    `scopes` as a component ("norm_out" matches transformer.norm_out.linear), or, for a scope with a
    dot, whose path is that scope ("transformer.proj_out" is Flux's final projection, and not
    transformer.single_transformer_blocks.0.proj_out, which the component "proj_out" would match)."""
    import ast

    paths = ast.literal_eval(metadata.get(NAME_SCOPES_KEY, "[]"))
    components = {s for s in scopes if "." not in s}
    return any(path in scopes or components & set(path.split(".")) for path in paths)


def nodes_in_scopes(proto, scopes, op_types) -> list[str]:
    """The `op_types` nodes of an ONNX model exported from a module under one of `scopes`."""
    return [node.name for node in proto.graph.node if node.op_type in op_types
            and in_scopes({p.key: p.value for p in node.metadata_props}, scopes)]
