"""The pass registry: every pass by name. Adding a pass is one module in this folder and one line
in `_PASSES`."""
from __future__ import annotations

from engines.passes.fold_constants import FoldConstants
from engines.passes.fuse_attention import FuseAttention
from engines.passes.fuse_elementwise import FuseElementwise
from engines.passes.fuse_qkv import FuseQKV
from engines.passes.infer_shapes import InferShapes
from engines.passes.quantize import QuantizeFp8, QuantizeInt8
from engines.passes.remat import Remat
from engines.passes.remove_dead_nodes import RemoveDeadNodes
from engines.passes.schedule_memory import ScheduleMemory
from engines.passes.to_bf16 import ToBf16
from engines.passes.to_fp16 import ToFp16

_PASSES = (FoldConstants, InferShapes, RemoveDeadNodes, FuseQKV, FuseAttention, ToFp16, ToBf16, QuantizeInt8,
           QuantizeFp8, FuseElementwise, ScheduleMemory, Remat)
PASSES: dict[str, type] = {p.name: p for p in _PASSES}


class UnknownPass(ValueError):
    pass


def check_pass_names(names) -> list[str]:
    names = [n for n in names if n]
    unknown = [n for n in names if n not in PASSES]
    if unknown:
        raise UnknownPass(f"unknown pass {', '.join(map(repr, unknown))}; known passes: {', '.join(PASSES)} "
                         f"(see python -m engines --list-passes)")
    return names


def describe_passes() -> str:
    width = max(map(len, PASSES))
    return "\n".join(f"{name:<{width}}  {cls.summary}" for name, cls in PASSES.items())
