"""The video table (issue 58's): Wan 2.1 text to video with guidance 5 and a negative prompt at 480x832 and 33
frames by default (bench/tables/family_table.py: diffusers eager fp32, our artifacts, each again with TaylorSeer)
and its goals. The VAE decode by frame count is bench/tables/wan_vae.py's."""
from __future__ import annotations

from bench.tables.family_table import FamilyTable, OURS_INT8, make_table

DIFFUSERS = "(a) diffusers WanPipeline, eager fp32"
TAYLORSEER = "taylorseer"  # diffusers' defaults (runners/caches/taylorseer.py)


def goals(size: str, references: int, measured: dict, variants) -> str:
    """Issue 58's goals at one size: openvino-int8 end to end against diffusers eager (no peer runs Wan on a CPU),
    and the same with TaylorSeer."""
    rows = measured[references]
    said = [f"{label} end to end is {rows[DIFFUSERS]['e2e'] / rows[label]['e2e']:.2f}x as fast as diffusers eager "
            f"(goal {goal}x)" for label, goal in ((OURS_INT8, 4), (f"{OURS_INT8} + {TAYLORSEER}", 6)) if label in rows]
    return f"Goals at {size}: {'; '.join(said) if said else 'not measured (no openvino-int8 artifact)'}."


TABLE = make_table(FamilyTable("wan", "wan", "Wan 2.1 text to video", steps=50,
                               settings="guidance 5 with a negative prompt", goals=goals, sizes="480x832", frames=33,
                               caches=(TAYLORSEER,), task="text to video"))
