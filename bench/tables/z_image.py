"""The Z-Image table (issue 55's): Z-Image-Turbo's settings (8 steps, guidance 0) at 512x512 and 1024x1024,
text to image (bench/tables/family_table.py), and its goals."""
from __future__ import annotations

from bench.tables.family_table import OURS_INT8, FamilyTable, int8_against_peers, load_goal, make_table


def goals(size: str, references: int, measured: dict, variants) -> str:
    """Issue 55's goals at one size, as measured: ratios of end-to-end and text-encoder medians."""
    rows = measured[references]
    genai = variants[-1].label
    said = int8_against_peers(rows, variants)
    if not said:
        return f"Goals at {size}: not measured (openvino-int8 is not among this run's artifacts)."
    ours = rows[OURS_INT8]
    said.append(f"its text encoder {rows[genai]['text'] / ours['text']:.1f}x as fast as openvino.genai's "
                f"({ours['text']:.3f} s against {rows[genai]['text']:.3f} s; goal 3x)")
    return f"Goals at {size}: {'; '.join([*said, load_goal(rows)])}."


TABLE = make_table(FamilyTable("z-image", "z_image", "Z-Image-Turbo", steps=8, settings="guidance 0", goals=goals))
