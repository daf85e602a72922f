"""LoRA branches in an OpenVINO model (runners/adapters/branches.py says why): beside each recorded
linear layer, `x @ A @ B` is added to the layer's output, with A (in x rank) and B (rank x out) two
new inputs of dynamic rank. A layer without an adapter is fed rank 0, which adds nothing."""
from __future__ import annotations

import numpy as np


def input_names(layer: dict) -> tuple[str, str]:
    return f"lora_A/{layer['matmul']}", f"lora_B/{layer['matmul']}"


def add_branches(model, layers: list[dict]) -> None:
    """Add a branch beside each of `layers` (runners.adapters.branches.branch_layers) to `model` in place."""
    import openvino as ov
    from openvino import opset13 as ops

    by_name = {op.get_friendly_name(): op for op in model.get_ops()}
    params = []
    for layer in layers:
        output = by_name[layer["output"]].output(0)
        x = by_name[layer["x"]].output(layer["x_port"])  # the float activation (int8: before its quantizer)
        pair = []
        for name, shape in zip(input_names(layer), ([layer["in"], -1], [-1, layer["out"]])):
            param = ops.parameter(ov.PartialShape(shape), ov.Type.f32, name=name)
            param.output(0).set_names({name})
            pair.append(param)
        readers = list(output.get_target_inputs())  # before the Add below becomes one of them
        low = ops.matmul(x, pair[0], layer["x_transposed"], False)
        branch = ops.add(output, ops.matmul(low, pair[1], False, False))
        for reader in readers:
            reader.replace_source_output(branch.output(0))
        params += pair
    model.add_parameters(params)
    model.validate_nodes_and_infer_types()


def branch_feeds(layers: list[dict], factors: dict) -> dict[str, np.ndarray]:
    """The inputs of every branch: the layer's (A, B) from `factors` ({matmul: (A, B)}), else rank 0."""
    feeds = {}
    for layer in layers:
        a, b = factors.get(layer["matmul"]) or (np.zeros((layer["in"], 0), np.float32),
                                                np.zeros((0, layer["out"]), np.float32))
        names = input_names(layer)
        feeds[names[0]], feeds[names[1]] = a, b
    return feeds
