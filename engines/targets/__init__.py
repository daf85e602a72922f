"""Build targets by name. A target turns one prepared ONNX graph into what its backend loads.

Adding a target is one module here with its `TARGETS` and one line in `_targets`.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from runners.static import StaticRequest


class TargetError(ValueError):
    """Unknown target or precision, a target whose backend is not installed, or one that needs a
    GPU on a machine without one."""


class SubmoduleBuildFailed(RuntimeError):
    """The target's builder rejected one submodule's graph (`--fallback ort` builds it for ONNX Runtime)."""


class EngineBuildError(RuntimeError):
    """The builder failed for a reason other than the graph (memory, the GPU, its settings): the build stops."""


@dataclass(frozen=True)
class BuildOptions:
    """Settings of the engine builders (TensorRT); the ONNX Runtime target has none to take."""

    # TensorRT: one fixed shape per input, those the runner calls for this request (runners/static.py),
    # instead of a min/opt/max profile; None: dynamic shapes.
    static: StaticRequest | None = None
    compute_capabilities: tuple[str, ...] = ()  # TensorRT-RTX: the GPUs to build for ("SM89", ...)
    workspace_mib: int | None = None  # the builder's workspace memory pool limit
    cache_dir: Path | None = None  # engines and the timing cache, reused across builds
    device: str | None = None  # OpenVINO: the device to compile for at build time ("CPU"); None: IR only
    # OpenVINO, the denoiser only: "dynamic" (one model for every shape) or "per-size" (reshaped to
    # each request's shapes at its first call, cached per size); None: the target's default.
    ov_shapes: str | None = None
    ov_sizes: tuple[tuple[int, int], ...] = ()  # OpenVINO: (height, width)s the denoiser is compiled static for

    def settings(self) -> dict:
        """What changes an engine: part of the artifact's cache key (the cache folder is not)."""
        openvino = {"device": self.device, "ov_shapes": self.ov_shapes, "ov_sizes": [list(s) for s in self.ov_sizes]}
        return {"static": self.static and self.static.record(), "compute_capabilities": list(self.compute_capabilities),
                "workspace_mib": self.workspace_mib, **{k: v for k, v in openvino.items() if v}}


@dataclass(frozen=True)
class BuildInput:
    """One submodule as a target builds it: its prepared graph, its manifest entry (inputs,
    outputs, dims with min/opt/max) and the pipeline's constant sizes."""

    model: Any  # onnx_ir.Model
    name: str
    entry: dict
    constants: dict
    # The precision as a target that takes it its own way builds it (engines.precisions.TargetRecipe:
    # OpenVINO's inference precision and int8 quantizer); None for the others.
    precision: Any = None
    calibration: Any = None  # engines.calibration.CalibrationFeeds when the precision measures the model
    weights: Any = None  # runners.provenance.WeightTable: where each weight comes from (LoRA, refit)

    def input_shapes(self) -> dict[str, tuple[list[int], list[int], list[int]]]:
        """{input: (min, opt, max) shape} from the entry's dims (a static build's are one value each)."""
        def at(shape, i):
            return [d if isinstance(d, int) else self.constants[d] if d in self.constants else self.entry["dims"][d][i]
                    for d in shape]

        return {t["name"]: tuple(at(t["shape"], i) for i in range(3)) for t in self.entry["inputs"]}

    def shapes_at(self, dims: dict[str, int]) -> dict[str, list[int]]:
        """{input: shape} with `dims` fixed and every other dim at its opt value."""
        opt = {name: shapes[1] for name, shapes in self.input_shapes().items()}
        return {t["name"]: [dims.get(d, v) if isinstance(d, str) else v for d, v in zip(t["shape"], opt[t["name"]])]
                for t in self.entry["inputs"]}


@dataclass(frozen=True)
class MemoryProfile:
    """What `--memory` adds to a target: passes that run after all others (the precision's too, so
    that the order they plan is the one that runs) and the runtime settings that keep what they
    did (recorded per submodule in the manifest, applied by the runner)."""

    passes: tuple[str, ...]
    session_options: dict = field(default_factory=dict)
    # {submodule: options that replace the defaults}, where measurement chose differently.
    overrides: dict = field(default_factory=dict)

    def options_for(self, submodule: str) -> dict:
        return {**self.session_options, **self.overrides.get(submodule, {})}


@dataclass(frozen=True)
class Target:
    name: str
    backend_module: str  # what must be importable to build and run it
    backend_distributions: tuple[str, ...]  # where its version is read from (first installed wins)
    install_hint: str
    precisions: tuple[str, ...]
    # The graph passes run before building, in order (names from engines.passes.PASSES).
    passes: tuple[str, ...]
    # (BuildInput, artifact folder, BuildOptions) -> (files written relative to the folder, what the
    # manifest records beside them). Raises SubmoduleBuildFailed when the builder rejects the graph.
    build_submodule: Callable[[BuildInput, Path, BuildOptions], tuple[list[str], dict]]
    # None, or why this machine cannot build for the target (TensorRT proper needs a GPU).
    unavailable: Callable[[], str | None] = lambda: None
    build_options: bool = False  # whether BuildOptions change what it builds (engine builders)
    memory: MemoryProfile | None = None  # None: the backend plans its own memory (TensorRT)
    refuses: dict = field(default_factory=dict)  # {precision it does not take: why}, said in its refusal

    def backend_version(self) -> str:
        for dist in self.backend_distributions:
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
        return "unknown"


def _targets() -> dict[str, Target]:
    from engines.targets import openvino, ort, trt

    return {t.name: t for t in (*ort.TARGETS, *trt.TARGETS, *openvino.TARGETS)}


def get_target(name: str, precision: str) -> Target:
    targets = _targets()
    if name not in targets:
        raise TargetError(f"unknown target '{name}'; known targets: {', '.join(targets)}")
    target = targets[name]
    takers = [t.name for t in targets.values() if precision in t.precisions]
    if precision not in target.precisions and takers:
        why = f" ({target.refuses[precision]})" if precision in target.refuses else ""
        raise TargetError(f"target '{name}' does not take precision '{precision}'{why}; "
                          f"the targets that take it: {', '.join(takers)}")
    if precision not in target.precisions:
        raise TargetError(f"unknown precision '{precision}' for target '{name}'; "
                          f"it builds: {', '.join(target.precisions)}")
    why = target.unavailable()
    if why:
        raise TargetError(f"target '{name}' cannot build on this machine: {why}")
    if importlib.util.find_spec(target.backend_module) is None:
        raise TargetError(f"target '{name}' needs the '{target.backend_module}' module, which is not "
                          f"installed: {target.install_hint}")
    return target


def describe_targets() -> str:
    return "\n".join(f"target {t.name} ({', '.join(t.precisions)}): passes {', '.join(t.passes) or 'none'}"
                     + (f"; --memory adds {', '.join(t.memory.passes)}" if t.memory else "")
                     for t in _targets().values())
