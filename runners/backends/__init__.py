"""Runtime backends by target name: each opens one engine file as a session whose
`run(feeds, release=False)` maps input names to numpy arrays and returns the outputs by name;
`release` frees the call's working memory when a stage is done."""
from __future__ import annotations


def open_session(target: str, path, **options):
    if target == "ort":
        from runners.backends.ort import OrtSession

        return OrtSession(path, **options)
    raise ValueError(f"this runner has no backend for target '{target}'; it runs: ort")
