"""What every step cache shares: the config base, the per-call state that counts evaluations, and
the registry and parser of the spelled configs (the CLI's --cache, serving's cache field)."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

CONFIGS: dict[str, type] = {}  # spelled name ("taylorseer") -> its config class, filled by register


def register(name: str, aliases: dict[str, str]):
    """Class decorator: a config spelled `name[:key=value,...]`, `aliases` mapping the short keys
    to the config's fields ({"interval": "cache_interval", ...})."""
    def add(cls):
        cls.spelled, cls.aliases = name, aliases
        CONFIGS[name] = cls
        return cls
    return add


class CacheConfig:
    """What every cache config answers (subclasses are dataclasses with diffusers' field names)."""

    spelled: str = ""
    aliases: dict[str, str] = {}
    positional: str | None = None  # the option a bare value sets ("first-block:0.08")

    def check(self, manifest: dict) -> None:
        """Refuse, in one line, an artifact this cache cannot run on (e.g. a transformer exported before its split)."""

    def start(self, pipe, num_steps: int, engine: str | None = None) -> "StepCache":
        """The state of one call of `pipe` with `num_steps` denoiser evaluations per context, on the denoiser graph
        `engine` (None: the artifact's; Wan 2.2 A14B's `transformer_2` after its handover gets a state of its own)."""
        raise NotImplementedError

    def _check_int(self, field: str, least: int, allow_none: bool = False, meaning: str = "") -> None:
        value = getattr(self, field)
        if value is None and allow_none:
            return
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
            raise ValueError(f"{type(self).__name__}: {field}={value!r} is not allowed: use an integer >= {least}"
                             f"{' or None' if allow_none else ''}{meaning}")


class GraphCacheConfig(CacheConfig):
    """A cache that runs a second graph of the denoiser on its cached steps (export/families/first_block.py,
    deep_cache.py): `graph` takes the denoiser's inputs and `output`, one of the denoiser's outputs, kept
    from a full step. Subclasses set these, `title`, `needs` (what the graph is) and `state` (their
    StepCache)."""

    graph = output = title = needs = instead = ""
    state: type

    def check(self, manifest: dict) -> None:
        denoiser = manifest["pipeline"]["denoiser"]
        outputs = {o["name"] for o in manifest["submodules"].get(denoiser, {}).get("outputs", ())}
        if self.graph not in manifest["submodules"] or self.output not in outputs:
            raise ValueError(f"{self.title} needs {self.needs} ({self.graph}); this artifact's {denoiser} has none "
                             f"({self.instead})")

    def start(self, pipe, num_steps: int, engine: str | None = None) -> "StepCache":
        graph = self.graph_for(pipe.constants["denoiser"], engine)
        if graph not in pipe.manifest["submodules"]:
            raise ValueError(f"{self.title} needs {graph} for {engine}; this artifact has none: export the model "
                             "again and rebuild, or use taylorseer")
        if graph not in pipe.opened:
            raise ValueError(f"{self.title} runs {graph}, which this pipeline did not open: load it without "
                             "`submodules=`, or with it among them")
        pipe.open_cache_graph(graph)
        state = self.state(self, pipe, num_steps)
        state.engine, state.graph = engine, graph
        return state

    @classmethod
    def graph_for(cls, denoiser: str, engine: str | None) -> str:
        """The cache's graph for the denoiser graph `engine`: transformer_2's `transformer_2_first_block`."""
        return cls.graph if engine is None else engine + cls.graph.removeprefix(denoiser)


def graph_caches() -> list[type]:
    """The registered caches that run a graph of their own (GraphCacheConfig's subclasses)."""
    return [c for c in CONFIGS.values() if issubclass(c, GraphCacheConfig)]


def cache_graphs(manifest: dict) -> set[str]:
    """The artifact's graphs that only a graph cache runs (`transformer_first_block`, `transformer_2_first_block`,
    `unet_shallow`): a pipeline opens them at the first call that caches with them, not at load, where a session
    would cost time and a copy of the first block's weights for calls that never run it."""
    denoiser, names = manifest["pipeline"]["denoiser"], set(manifest["submodules"])
    return {c.graph_for(denoiser, engine) for c in graph_caches() for engine in names} & names


class StepCache:
    """One call's cache state. This base class caches nothing: every evaluation runs in full. It counts
    evaluations and their seconds, full and cached (what `Pipeline.cache_stats` reports)."""

    # a graph cache's: the denoiser graph it caches (None: the artifact's) and its own graph for it
    engine: str | None = None
    graph = ""

    def __init__(self, pipe, num_steps: int):
        self.pipe, self.num_steps = pipe, num_steps  # a cache that runs parts of the denoiser calls the pipe
        self.stats = {"full": 0, "cached": 0, "full_seconds": 0.0, "cached_seconds": 0.0}

    def __call__(self, step: int, context: str, inputs: tuple, run_full: Callable[[], np.ndarray]) -> np.ndarray:
        """The denoiser's output at `step` for `context` (a name for one stream of evaluations, as
        diffusers' `cache_context`: "batch" for guidance batched in one call, "cond"/"uncond" when a
        loop calls them apart; "uncond,cond" names the halves of one batched call). `inputs` are the
        evaluation's (latents, timestep, conditions); `run_full()` runs the whole denoiser on them, and
        `run_full(release=True)` frees its working memory afterwards (by default only on the last step)."""
        t0 = time.perf_counter()
        output, kind = self.evaluate(step, context, inputs, run_full)
        self.stats[kind] += 1
        self.stats[f"{kind}_seconds"] += time.perf_counter() - t0
        return output

    def evaluate(self, step: int, context: str, inputs: tuple, run_full) -> tuple[np.ndarray, str]:
        """(output, "full" or "cached")."""
        return run_full(), "full"


def merged_stats(caches) -> dict:
    """One call's `cache_stats` over its denoisers' states (a handover's two, in the order they ran): counts and
    seconds summed, each context's decisions in step order."""
    stats = {}
    for cache in caches:
        for key, value in cache.stats.items():
            if key == "decisions":
                for context, decisions in value.items():
                    stats.setdefault(key, {}).setdefault(context, []).extend(decisions)
            else:
                stats[key] = stats.get(key, 0) + value
    return stats


def _value(cls, key: str, text: str):
    """One `key=value` of a spelled config, as its field's type."""
    field = cls.aliases.get(key, key)
    allowed = ", ".join(f"{alias} ({f})" for alias, f in cls.aliases.items())
    if field not in cls.aliases.values():
        raise ValueError(f"cache {cls.spelled}: unknown option {key!r}; allowed: {allowed}")
    if text.lower() in ("none", ""):
        return field, None
    if text.lower() in ("true", "false"):
        return field, text.lower() == "true"
    try:
        return field, int(text)
    except ValueError:
        pass
    try:
        return field, float(text)
    except ValueError:
        raise ValueError(f"cache {cls.spelled}: {key}={text!r} is not a number") from None


def parse_cache(text: str):
    """"taylorseer:interval=3,before=6,after=-2,order=1" -> TaylorSeerCacheConfig(...); "none" -> None.
    Options left out take the config's defaults."""
    name, _, options = text.strip().partition(":")
    name = name.strip().lower()
    if name in ("", "none", "off"):
        return None
    if name not in CONFIGS:
        raise ValueError(f"cache {name!r} is not known; known: {', '.join(CONFIGS)} (or none)")
    cls = CONFIGS[name]
    fields = {}
    for item in filter(None, (part.strip() for part in options.split(","))):
        key, sep, value = item.partition("=")
        if not sep and getattr(cls, "positional", None):  # "first-block:0.08" names its one main option
            key, value = cls.positional, item
        elif not sep:
            raise ValueError(f"cache {name}: option {item!r} is not KEY=VALUE (e.g. {name}:"
                             f"{next(iter(cls.aliases))}=3)")
        field, parsed = _value(cls, key.strip().lower(), value.strip())
        fields[field] = parsed
    return cls(**fields)

