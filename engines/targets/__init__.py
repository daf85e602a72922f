"""Build targets by name. A target turns one prepared ONNX graph into what its backend loads.

Adding a target is one module here that lists it in `TARGETS` (its options, flags, precisions and
builder with it) and the runner's backend it names, one module in runners/backends: the registries
find both, and nothing else names them (docs/targets.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import pkgutil
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, ClassVar

from runners.backends import registry as backend_registry


class TargetError(ValueError):
    """Unknown target or precision, a target whose backend is not installed, or one that needs a
    GPU on a machine without one."""


class SubmoduleBuildFailed(RuntimeError):
    """The target's builder rejected one submodule's graph (`--fallback ort` builds it for ONNX Runtime)."""


class EngineBuildError(RuntimeError):
    """The builder failed for a reason other than the graph (memory, the GPU, its settings): the build stops."""


def sizes_argument(text: str) -> tuple[tuple[int, int], ...]:
    """A command line's list of image sizes, "512x512,768x1024" (height x width): ((512, 512), (768, 1024))."""
    sizes = [size.split("x") for size in text.split(",")]
    if not all(len(sides) == 2 and all(side.isdigit() for side in sides) for sides in sizes):
        raise argparse.ArgumentTypeError(f"'{text}' is not a list of sizes like 512x512,768x1024 "
                                         "(height x width in pixels)")
    return tuple((int(h), int(w)) for h, w in sizes)


def folder_suffix(*parts: str | None | bool) -> str:
    """An artifact folder's suffix from the options that name it, those that are unset left out:
    ("int8-weights", None, "cpu") -> "-int8-weights-cpu"."""
    return "".join(f"-{part}" for part in parts if part)


@dataclass(frozen=True)
class TargetOptions:
    """A target's own build options: a frozen dataclass subclass holds them, adds the command-line flags
    that set them (`add_arguments`, `from_args`: the CLI is a thin layer over the same object), and says
    which of them change an engine (`settings`, part of the artifact's cache key). This base has none
    (ONNX Runtime's target)."""

    title: ClassVar[str] = ""  # what the CLI's heading for its flags calls them

    @classmethod
    def add_arguments(cls, group) -> None:
        """Add its flags to an argparse group."""

    @classmethod
    def from_args(cls, args) -> "TargetOptions":
        return cls()

    def settings(self) -> dict:
        """What changes an engine: part of the artifact's cache key and its manifest's build_options."""
        return {}

    def resolved(self, build_dir: Path, source: dict, precision: str) -> "TargetOptions":
        """The options with the defaults that depend on the build filled in and checked against the
        export's manifest `source` and the `precision` built (TargetError when they do not fit)."""
        return self

    def variant(self) -> str:
        """What the artifact's folder name adds for these options ("-static-512x512"): see `folder_suffix`."""
        return ""

    def entry(self, name: str, entry: dict, source: dict) -> dict:
        """Submodule `name`'s manifest entry as the engine is built for it (a static build fixes its dims)."""
        return entry

    def record(self) -> dict:
        """What the artifact's manifest records about these options beside the settings (the static request)."""
        return {}


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
    weights: Any = None  # runners.adapters.provenance.WeightTable: where each weight comes from (LoRA, refit)
    # Called once the target has read the graph's weights into files of its own (engines --remove-export then
    # deletes the exported ones); the build calls it after the target if the target does not
    source_read: Callable[[], None] = lambda: None

    def input_shapes(self) -> dict[str, tuple[list[int], list[int], list[int]]]:
        """{input: (min, opt, max) shape} from the entry's dims (a static build's are one value each)."""
        def at(shape, i):
            # a dim's range first: a constant of the same name must not fix its size
            dims = self.entry["dims"]
            return [d if isinstance(d, int) else dims[d][i] if d in dims else self.constants[d] for d in shape]

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
    backend: str  # the runner's backend that opens its engines (runners/backends), recorded in the manifest
    backend_module: str  # what must be importable to build and run it
    backend_distributions: tuple[str, ...]  # where its version is read from (first installed wins)
    install_hint: str
    precisions: tuple[str, ...]
    # The graph passes run before building, in order (names from engines.passes.PASSES).
    passes: tuple[str, ...]
    # (BuildInput, artifact folder, its options) -> (files written relative to the folder, what the
    # manifest records beside them). Raises SubmoduleBuildFailed when the builder rejects the graph.
    build_submodule: Callable[[BuildInput, Path, TargetOptions], tuple[list[str], dict]]
    options: type[TargetOptions] = TargetOptions  # its own options (a subclass), shared by targets of one builder
    # None, or why this machine cannot build for the target (TensorRT proper needs a GPU).
    unavailable: Callable[[], str | None] = lambda: None
    memory: MemoryProfile | None = None  # None: the backend plans its own memory (TensorRT)
    refuses: dict = field(default_factory=dict)  # {precision it does not take: why}, said in its refusal
    # {precision: engines.precisions.TargetRecipe} it takes its own way (OpenVINO: a runtime hint, its own
    # quantizer): those run none of the precision's passes.
    own_precisions: dict = field(default_factory=dict)

    def backend_version(self) -> str:
        for dist in self.backend_distributions:
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
        return "unknown"


def registry() -> dict[str, Target]:
    """{name: target} of every module of this package: each lists its targets in `TARGETS` (a module
    whose name starts with '_' is a helper). Every target names a backend the runner has."""
    targets = {}
    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_"):
            targets.update((t.name, t) for t in importlib.import_module(f"{__name__}.{module.name}").TARGETS)
    runnable = backend_registry()
    for t in targets.values():
        if t.backend not in runnable:
            raise TargetError(f"target '{t.name}' names the runner backend '{t.backend}', which runners/backends does "
                              f"not have (it has: {', '.join(runnable)}): add runners/backends/{t.backend}.py")
    return dict(sorted(targets.items()))


def owners(options: type[TargetOptions]) -> str:
    """The targets that take `options`, as an error names them."""
    return ", ".join(sorted(t.name for t in registry().values() if t.options is options))


def refuse_foreign(target: Target, given: dict[type[TargetOptions], list[str]]) -> None:
    """Refuse options (flags or fields, by the options class that holds them) of other targets than `target`."""
    for cls, names in given.items():
        if names and cls is not target.options:
            owned, plural = owners(cls), len(names) > 1
            raise TargetError(f"{', '.join(names)} {'are options' if plural else 'is an option'} of the {owned} "
                              f"target{'s' if ', ' in owned else ''}; target '{target.name}' takes none of "
                              f"{'them' if plural else 'it'}")


class _Recorded:
    """An argparse group that keeps the actions added to it: which flags belong to which options."""

    def __init__(self, group):
        self.group, self.actions = group, []

    def add_argument(self, *args, **kwargs):
        self.actions.append(self.group.add_argument(*args, **kwargs))
        return self.actions[-1]


def add_target_arguments(parser) -> dict[type[TargetOptions], list[argparse.Action]]:
    """Every target's flags, one group per options class (the targets that share one share the group):
    {options class: its flags' actions}, for `options_from_args`."""
    flags = {}
    for target in registry().values():
        if target.options not in flags:
            group = _Recorded(parser.add_argument_group(f"{target.options.title} options ({owners(target.options)})"))
            target.options.add_arguments(group)
            flags[target.options] = group.actions
    return flags


def options_from_args(name: str, args, flags: dict[type[TargetOptions], list[argparse.Action]]) -> TargetOptions:
    """Target `name`'s options from the parsed command line; a flag of another target's is refused."""
    target = get_target_named(name)
    refuse_foreign(target, {cls: [a.option_strings[0] for a in actions if getattr(args, a.dest) != a.default]
                            for cls, actions in flags.items()})
    return target.options.from_args(args)


# A TargetOptions field with this metadata is filled in by `resolved` from the export, not given by a user.
RESOLVED = {"resolved": True}


def _option_names(options: type) -> set[str]:
    return {f.name for f in dataclasses.fields(options) if not f.metadata.get("resolved")}


def target_options(name: str, **kwargs) -> TargetOptions:
    """Target `name`'s options from keyword arguments (`target_options("trt-rtx", workspace_mib=512)`);
    an argument of another target's options is refused, naming the targets it belongs to."""
    target = get_target_named(name)
    fields = _option_names(target.options)
    foreign = {}
    for key in sorted(set(kwargs) - fields):
        holders = [t.options for t in registry().values() if key in _option_names(t.options)]
        if not holders:
            raise TargetError(f"{key} is no option of any target; target '{name}' takes: {', '.join(sorted(fields)) or 'none'}")
        foreign.setdefault(holders[0], []).append(key)
    refuse_foreign(target, foreign)
    return target.options(**kwargs)


def get_target_named(name: str) -> Target:
    targets = registry()
    if name not in targets:
        raise TargetError(f"unknown target '{name}'; known targets: {', '.join(targets)}")
    return targets[name]


def get_target(name: str, precision: str) -> Target:
    """Target `name`, checked to take `precision` and to build on this machine."""
    targets, target = registry(), get_target_named(name)
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
    def own(t: Target) -> str:
        return "".join(f"; {precision}: no passes, runtime {', '.join(f'{k}={v}' for k, v in r.runtime.items())}"
                       + (", int8 by its own quantizer" if r.quantize else "") for precision, r in t.own_precisions.items())

    return "\n".join(f"target {t.name} ({', '.join(t.precisions)}): passes {', '.join(t.passes) or 'none'}"
                     + (f"; --memory adds {', '.join(t.memory.passes)}" if t.memory else "") + own(t)
                     for t in registry().values())
