"""Graph passes by name (`registry.py`). Adding a pass is one module here and one line in
`registry._PASSES`.

A target declares its pipeline as a list of these names (`engines/targets/`); the CLI's
`--passes a,b,c` replaces that list and `--list-passes` prints this registry.
"""
from __future__ import annotations

from engines.passes.base import GraphPass, LibraryPass, PassContext, Report, Transformed
from engines.passes.library_output import show_library_output
from engines.passes.pipeline import PassFailed, PassPipeline, run_passes
from engines.passes.registry import PASSES, UnknownPass, check_pass_names, describe_passes

__all__ = ["PASSES", "GraphPass", "LibraryPass", "PassContext", "PassFailed", "PassPipeline", "Report", "Transformed",
           "UnknownPass", "run_passes", "check_pass_names", "describe_passes", "show_library_output"]
