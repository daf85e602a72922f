"""Build targets by name. A target turns one prepared ONNX graph into what its backend loads.

Adding a target is one module here with a `TARGET` and one line in `TARGETS`.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable


class TargetError(ValueError):
    """Unknown target or precision, or a target whose backend is not installed."""


@dataclass(frozen=True)
class Target:
    name: str
    backend_module: str  # what must be importable to build and run it
    backend_distributions: tuple[str, ...]  # where its version is read from (first installed wins)
    install_hint: str
    precisions: tuple[str, ...]
    # The graph passes run before building, in order (names from engines.passes.PASSES).
    passes: tuple[str, ...]
    # (prepared onnx-ir model, artifact folder, submodule name) -> files written, relative to the folder
    build_submodule: Callable[[Any, Path, str], list[str]]

    def backend_version(self) -> str:
        for dist in self.backend_distributions:
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
        return "unknown"


def _targets() -> dict[str, Target]:
    from engines.targets import ort

    return {t.name: t for t in (ort.TARGET,)}


def get_target(name: str, precision: str) -> Target:
    targets = _targets()
    if name not in targets:
        raise TargetError(f"unknown target '{name}'; known targets: {', '.join(targets)}")
    target = targets[name]
    if precision not in target.precisions:
        raise TargetError(f"unknown precision '{precision}' for target '{name}'; "
                          f"it builds: {', '.join(target.precisions)}")
    if importlib.util.find_spec(target.backend_module) is None:
        raise TargetError(f"target '{name}' needs the '{target.backend_module}' module, which is not "
                          f"installed: {target.install_hint}")
    return target


def describe_targets() -> str:
    return "\n".join(f"target {t.name} ({', '.join(t.precisions)}): passes {', '.join(t.passes) or 'none'}"
                     for t in _targets().values())
