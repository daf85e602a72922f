"""The LTX-Video rows of the video table (issue 58's): text to video with guidance 3 and a negative prompt
(bench/tables/family_table.py: diffusers eager fp32, our artifacts, each again with TaylorSeer, and with
--optimum-intel-python optimum-intel's OVLTXPipeline and openvino.genai's Text2VideoPipeline on optimum-intel's
export, at their defaults) and its goals."""
from __future__ import annotations

from bench.tables.family_table import FamilyTable, int8_against_peers, make_table


def goals(size: str, references: int, measured: dict, variants) -> str:
    """Issue 58's LTX-Video goal at one size: openvino-int8 end to end against openvino.genai's default and
    optimum-intel's."""
    said = int8_against_peers(measured[references], variants)
    return f"Goals at {size}: {'; '.join(said) if said else 'not measured (no openvino-int8 artifact)'}."


TABLE = make_table(FamilyTable("ltx", "ltx", "LTX-Video text to video", steps=50,
                               settings="guidance 3 with a negative prompt", goals=goals, sizes="512x704", frames=41,
                               smoke_frames=9, cold_steps=2, prompt_tokens=128, caches=("taylorseer",),
                               task="text to video"))
