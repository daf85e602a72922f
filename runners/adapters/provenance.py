"""Weight provenance: where every initializer that holds model parameters comes from.

A `WeightTable` maps an initializer's name to its record:

    {"dtype": "float16", "shape": [64, 192],
     "parts": [{"component": "transformer", "key": "transformer_blocks.0.attn.to_q.weight",
                "perm": [1, 0], "axis": 1, "start": 0, "stop": 64}, ...],
     "quantized": {"scale": "<initializer>", "zero_point": "<initializer>", "axis": 1}}   # int8 / fp8 only
    {"dtype": "float32", "shape": [192], "parts": [], "scale_of": "<initializer>"}       # its scale

Each part says: the checkpoint tensor `key` of pipeline `component`, transposed by `perm` (none:
as stored), is the slice `start:stop` of the initializer along `axis` (no axis: all of it), in the
record's dtype. A quantized initializer's parts describe its dequantized values.

The export writes the table beside each graph (`<graph stem>.weights.json`), every pass keeps it
true (a pass that makes a weight from others records how), and the artifact carries it next to
each engine: an adapter (`runners/adapters/lora.py`) or a refit changes a built artifact through it.
"""
from __future__ import annotations

import json
from pathlib import Path

SUFFIX = ".weights.json"


def table_path(graph_file: Path) -> Path:
    graph_file = Path(graph_file)
    return graph_file.with_name(graph_file.name.split(".")[0] + SUFFIX)


class WeightTable(dict):
    """{initializer name: record}, and `unread`: the (component, key) pairs of checkpoint tensors
    the graph never reads (SDXL's last CLIP layer, whose output the pipeline skips; the VAE
    encoder's half in the decoder's graph). An adapter may change those without effect."""

    def __init__(self, records=(), unread=()):
        super().__init__(records)
        self.unread = {tuple(p) for p in unread}

    def source(self, name: str, component: str, key: str, dtype: str, shape) -> None:
        """`name` holds checkpoint tensor `key` of `component` as it is."""
        self[name] = {"dtype": dtype, "shape": list(shape), "parts": [{"component": component, "key": key}]}

    def transposed(self, old: str, new: str, perm: list[int], shape) -> None:
        """`new` is `old` transposed by `perm` (whole tensors only: a slice would move). `old`'s own
        record stays while the graph still reads it."""
        record = self[old]
        if any("axis" in p for p in record["parts"]):
            raise ValueError(f"{old}: a transpose of a concatenation is not recorded")
        parts = [{**p, "perm": _compose(p.get("perm"), perm, len(shape))} for p in record["parts"]]
        self[new] = {**record, "shape": list(shape), "parts": parts}

    def concatenated(self, new: str, pieces: list[tuple[str, int]], axis: int, shape, dtype: str) -> None:
        """`new` is the concatenation along `axis` of the initializers `pieces` ([(name, width)]).
        A piece without a record (a zero bias made for the concatenation) takes its width only."""
        parts, start = [], 0
        for name, width in pieces:
            for p in self.get(name, {}).get("parts", []):
                if "axis" in p:
                    raise ValueError(f"{name} is already a concatenation")
                parts.append({**p, "axis": axis, "start": start, "stop": start + width})
            start += width
        if parts:
            self[new] = {"dtype": dtype, "shape": list(shape), "parts": parts}

    def reconcile(self, initializers: dict) -> dict[str, int]:
        """Keep the records true to a graph's initializers ({name: (dtype, shape)}): a record whose
        initializer is gone is dropped (a pass removed an unused weight, or made it part of another,
        which has its own record), a cast updates dtype and shape. Returns the counts a report shows:
        the weights tracked, and the parameters no initializer holds any more."""
        before = self.parameters()
        for name in [n for n in self if n not in initializers]:
            del self[name]
        for name, record in self.items():
            dtype, shape = initializers[name]
            record["dtype"], record["shape"] = dtype, list(shape)
        return {"weights_tracked": len(self), "parameters_lost": len(before - self.parameters())}

    def locate(self, graph_file: Path) -> None:
        """Record where each weight's bytes are in a saved ONNX graph's external data file:
        {"file", "offset", "length"}, read in place by a runner that applies adapters."""
        import onnx_ir as ir

        graph_file = Path(graph_file)
        initializers = ir.load(graph_file).graph.initializers
        for name, record in self.items():
            tensor = initializers[name].const_value
            if isinstance(tensor, ir.ExternalTensor):
                record["location"] = {"file": tensor.location, "offset": tensor.offset, "length": tensor.length}

    def unlocate(self) -> None:
        """Forget where `locate` found the weights (another graph file's places)."""
        for record in self.values():
            record.pop("location", None)

    def parameters(self) -> set[tuple[str, str]]:
        """Every (component, checkpoint key) some initializer holds."""
        return {(p["component"], p["key"]) for r in self.values() for p in r["parts"]}

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps({"unread": sorted(self.unread), "weights": dict(sorted(self.items()))},
                                         indent=0))

    @classmethod
    def load(cls, path: Path) -> WeightTable:
        path = Path(path)
        if not path.exists():
            return cls()
        data = json.loads(path.read_text())
        return cls(data["weights"], data["unread"])


def dtype_name(dtype) -> str:
    """numpy's name for an onnx-ir data type: float32, float16, bfloat16, int8, float8_e4m3fn."""
    import numpy as np

    return np.dtype(dtype.numpy()).name


def initializer_types(model) -> dict[str, tuple[str, list]]:
    """{name: (dtype, shape)} of an onnx-ir model's initializers, as `reconcile` takes them."""
    return {name: (dtype_name(v.const_value.dtype), list(v.const_value.shape))
            for name, v in model.graph.initializers.items() if v.const_value is not None}


def _compose(first: list[int] | None, then: list[int], rank: int) -> list[int] | None:
    """The permutation of applying `first` and then `then`; None for the identity."""
    first = first or list(range(rank))
    perm = [first[i] for i in then]
    return None if perm == list(range(rank)) else perm
