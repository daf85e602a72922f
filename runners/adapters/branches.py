"""LoRA as low-rank branches beside an engine's linear layers, for backends that add them to the
graph instead of changing its weights (OpenVINO: runners/backends/_openvino_lora.py).

A layer whose weight an adapter changes by `delta` computes `y = x @ M + x @ A @ B`, with
`A @ B = delta` in the layer's own layout (M: in x out), every adapter's pairs concatenated along
the rank. The base weights stay as built (int8 ones too), and switching adapters changes only A and
B, which the engine reads as inputs: nothing is compiled again. The layers are the ones the build
recorded in the weight table (`record["openvino"]`, engines/targets/_openvino_lora.py). Numpy only.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from runners.adapters.lora import LoraError, in_merge_order, read_adapter, submodule_tables

KEY = "openvino"  # the weight records' entry that lists a weight's layers in the IR


def adapter_pairs(loras: dict, parameters: set, unread: set = frozenset(), ignore_unmatched: bool = False,
                  family: str | None = None) -> dict[tuple[str, str], list[tuple[np.ndarray, np.ndarray]]]:
    """{(component, checkpoint key): [(up * scale * alpha / rank, down)]} of every adapter, each pair
    in the checkpoint's layout: the weight's change is up @ down."""
    pairs: dict[tuple[str, str], list] = {}
    for path, scale in in_merge_order(loras):
        for layer in read_adapter(path, parameters, unread, ignore_unmatched, family):
            if layer.down.ndim != 2:
                raise LoraError(f"{path}: {layer.component}.{layer.module} is a convolution; adapters reach an "
                                f"OpenVINO artifact's linear layers only (apply it to the ONNX Runtime artifact)")
            rank = layer.down.shape[0]
            up = layer.up.reshape(layer.up.shape[0], rank) * np.float32(float(scale) * layer.alpha / rank)
            pairs.setdefault((layer.component, layer.key), []).append((up, layer.down))
    return pairs


def weight_factors(record: dict, pairs: dict) -> tuple[np.ndarray, np.ndarray] | None:
    """(L, R) with L @ R the change of the weight `record` describes, in its own layout; None if no
    adapter touches it. A fused weight's part adds its rows or columns, zero elsewhere."""
    touched = [p for p in record["parts"] if (p["component"], p["key"]) in pairs]
    if not touched:
        return None
    whole = [p for p in record["parts"] if "axis" not in p]
    if len(whole) > 1:
        raise LoraError(f"the weight holding {', '.join(p['key'] for p in whole)} (equal parameters the exporter "
                        f"merged): an adapter cannot change one of them alone")
    rows, cols = record["shape"]
    lefts, rights = [], []
    for part in touched:
        for up, down in pairs[(part["component"], part["key"])]:
            left, right = (down.T, up.T) if part.get("perm") == [1, 0] else (up, down)
            if "axis" in part:
                span = slice(part["start"], part["stop"])
                if part["axis"] == 0:
                    left = _placed(left, (rows, left.shape[1]), (span, slice(None)))
                else:
                    right = _placed(right, (right.shape[0], cols), (slice(None), span))
            if (left.shape[0], right.shape[1]) != (rows, cols):
                raise LoraError(f"{part['component']}.{part['key']}: the adapter's change has shape "
                                f"{(left.shape[0], right.shape[1])}, the weight {(rows, cols)}: the adapter is for "
                                f"another model")
            lefts.append(left)
            rights.append(right)
    return np.concatenate(lefts, axis=1).astype(np.float32), np.concatenate(rights, axis=0).astype(np.float32)


def _placed(block: np.ndarray, shape: tuple, index: tuple) -> np.ndarray:
    out = np.zeros(shape, np.float32)
    out[index] = block
    return out


def branch_factors(folder: Path, manifest: dict, loras: dict,
                   ignore_unmatched: bool = False) -> dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """{submodule: {layer (the IR MatMul's name): (A, B)}} for `loras` ({path: scale}), with
    x @ A @ B the layer's change: A is in x rank, B rank x out."""
    if not loras:
        return {}
    tables = submodule_tables(folder, manifest)
    parameters = set().union(*(t.parameters() for t in tables.values())) if tables else set()
    unread = (set().union(*(t.unread for t in tables.values())) - parameters) if tables else set()
    pairs = adapter_pairs(loras, parameters, unread, ignore_unmatched, manifest["model"]["family"])
    out: dict[str, dict] = {}
    unreached = []
    for submodule, table in tables.items():
        for name, record in table.items():
            factors = weight_factors(record, pairs)
            if factors is None:
                continue
            if not record.get(KEY):
                unreached.append(f"{submodule}:{name}")
                continue
            left, right = factors
            for layer in record[KEY]:
                # The layer multiplies by the weight (in x out), or by its transpose (Gemm transB).
                pair = (right.T, left.T) if layer["transposed"] else (left, right)
                out.setdefault(submodule, {})[layer["matmul"]] = tuple(np.ascontiguousarray(f) for f in pair)
    if unreached:
        raise LoraError(f"{folder}: adapters change {len(unreached)} weights that no linear layer of the IR reads "
                        f"directly ({', '.join(unreached[:5])}); apply them to the ONNX Runtime artifact")
    return out


def branch_layers(table) -> list[dict]:
    """Every layer of an engine that a branch can reach, each once: its record
    (engines/targets/_openvino_lora.py) with the sizes "in" and "out" of its change."""
    layers = {}
    for record in table.values():
        rows, cols = record["shape"] if len(record["shape"]) == 2 else (0, 0)
        for layer in record.get(KEY, ()):
            size = (cols, rows) if layer["transposed"] else (rows, cols)
            layers[layer["matmul"]] = {**layer, "in": size[0], "out": size[1]}
    return list(layers.values())
