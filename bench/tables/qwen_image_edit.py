"""The Qwen-Image-Edit table (issue 57's Edit row): editing one input image with true CFG (scale 4, a negative
prompt) at the model's 50 steps or the Lightning recipe's 8 (--qwen-image-edit-steps), on qwen-image-edit-bench
(bench/tables/family_table.py). No peer runs Qwen-Image-Edit on a CPU: the goal is against diffusers eager."""
from __future__ import annotations

from bench.tables.family_table import OURS_INT8, FamilyTable, make_table

GOAL = 4.0  # openvino-int8 end to end against diffusers eager


def goals(size: str, references: int, measured: dict, variants) -> str:
    rows, diffusers = measured[references], variants[0].label
    if OURS_INT8 not in rows:
        return f"Goal at {size}: not measured (no openvino-int8 artifact)."
    ratio = rows[diffusers]["e2e"] / rows[OURS_INT8]["e2e"]
    return (f"Goal at {size}: openvino-int8 edits {ratio:.2f}x as fast as diffusers eager end to end "
            f"(goal {GOAL:.0f}x).")


TABLE = make_table(FamilyTable("qwen-image-edit", "qwen_image_edit", "Qwen-Image-Edit", steps=50,
                               settings="true CFG 4 with a negative prompt", edits=(1,), text_to_image=False,
                               goals=goals, cold_steps=2))
