"""The Qwen-Image table (issue 57's): text to image with true CFG (scale 4, a negative prompt) at 512x512 and
1024x1024 (bench/tables/family_table.py), at the model's 50 steps or the Lightning recipe's 8
(--qwen-image-steps), and its goals."""
from __future__ import annotations

from bench.tables.family_table import FamilyTable, int8_against_peers, make_table


def goals(size: str, references: int, measured: dict, variants) -> str:
    """Issue 57's goal at one size, as measured: openvino-int8's end-to-end medians against the peers'."""
    said = int8_against_peers(measured[references], variants)
    return f"Goals at {size}: {'; '.join(said) if said else 'not measured (no openvino-int8 artifact)'}."


TABLE = make_table(FamilyTable("qwen-image", "qwen_image", "Qwen-Image", steps=50,
                               settings="true CFG 4 with a negative prompt", goals=goals, cold_steps=2))
