"""The FLUX.2 table (issue 56's): klein's distilled settings (4 steps, no guidance) at 512x512 and 1024x1024, text
to image and editing from one and two references (bench/tables/family_table.py), and its goals."""
from __future__ import annotations

from bench.tables.family_table import OURS_INT8, FamilyTable, load_goal, make_table


def goals(size: str, references: int, measured: dict, variants) -> str | None:
    """Issue 56's goals at one size and task, as measured: openvino-int8 end to end against the peers (text to
    image and one reference), the step with two references against one's, our load plus first call."""
    rows = measured[references]
    if OURS_INT8 not in rows:
        return f"Goals at {size}: not measured (openvino-int8 is not among this run's artifacts)."
    ours, where = rows[OURS_INT8], f"at {size}, {'text to image' if not references else 'editing'}"
    if references == 2:
        if 1 not in measured:
            return f"Goal {where}: not measured (two references against one, which this run did not measure)."
        said = [f"with two references the step of {label} takes {rows[label]['step'] / measured[1][label]['step']:.2f}x "
                "its step with one" for label in rows if label.startswith("ours")]
        return f"Goal {where}: {'; '.join(said)} (goal at most 1.2x)."
    peers = [(v.label, what) for v in variants for peer, what in (("genai", "openvino.genai's default"),
                                                                   ("optimum-intel", "optimum-intel's"))
             if peer in v.kind]
    said = [f"openvino-int8 end to end is {rows[label]['e2e'] / ours['e2e']:.2f}x as fast as {what} (goal 1.5x)"
            for label, what in peers]
    return f"Goals {where}: {'; '.join([*said, load_goal(rows)])}."


TABLE = make_table(FamilyTable("flux2", "flux2", "FLUX.2 klein", steps=4, settings="distilled: no guidance",
                               edits=(1, 2), goals=goals))
