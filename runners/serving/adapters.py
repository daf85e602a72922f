"""LoRA adapters chosen per request (`python -m runners serve ART --lora-dir DIR`). A request names
adapter files of DIR with their scales, `loras: '[{"name": "style", "scale": 0.8}]'`; the model
switches its Pipeline to that set between executions, never during one (runners/serving/
triton_model.py), and requests batch together only when they name the same set. The adapted weights
of the most recently used sets are kept within a memory bound, so that switching back to a set does
not compute them again. Pure numpy and the standard library, like the rest of the runner."""
from __future__ import annotations

import json
import math
from collections import OrderedDict
from pathlib import Path

MAX_SCALE = 10.0  # a larger |scale| is refused: no adapter is meant to be applied that hard
EXAMPLE = '[{"name": "style", "scale": 0.8}]'


def parse(text: str, row: int) -> tuple[tuple[str, float], ...]:
    """A request's `loras` field -> ((name, scale), ...) in name order: the set's identity, which the
    batching compares."""
    try:
        items = json.loads(text) if text.strip() else []
    except json.JSONDecodeError as e:
        raise ValueError(f"loras[{row}] is not JSON ({e.msg}): send a list such as {EXAMPLE}") from None
    if not isinstance(items, list) or not all(isinstance(i, dict) and isinstance(i.get("name"), str)
                                              and set(i) <= {"name", "scale"} for i in items):
        raise ValueError(f"loras[{row}] must be a list of {{\"name\", \"scale\"}} objects, such as {EXAMPLE}")
    pairs: dict[str, float] = {}
    for item in items:
        name, scale = item["name"], item.get("scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
                or abs(scale) > MAX_SCALE:
            raise ValueError(f"loras[{row}]: scale {scale!r} of {name!r} is not allowed: use a finite number from "
                             f"{-MAX_SCALE:g} to {MAX_SCALE:g}")
        if name in pairs:
            raise ValueError(f"loras[{row}] names {name!r} twice: name each adapter once, with its total scale")
        pairs[name] = float(scale)
    return tuple(sorted(pairs.items()))


def _nbytes(value) -> int:
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return getattr(value, "nbytes", 0)


class AdapterSets:
    """The adapters of `folder` a server applies: at most `max_loras` a request, the adapted weights of
    recent sets kept within `cache_bytes` (the current set's always), and the switches counted."""

    def __init__(self, folder: str | None, max_loras: int, cache_bytes: int, log=print):
        self.folder = Path(folder).resolve() if folder else None
        self.max_loras, self.cache_bytes, self.log = max_loras, cache_bytes, log
        self.current: tuple = ()
        self.switches = 0
        self._kept: OrderedDict[tuple, tuple] = OrderedDict()  # set -> (the Pipeline's adapter inputs, bytes)

    def paths(self, pairs: tuple) -> dict[str, float]:
        """{adapter file: scale} of a parsed set; a name that is not a file of the folder is refused."""
        if pairs and self.folder is None:
            raise ValueError("loras: this server serves no adapters (it was started without --lora-dir)")
        if len(pairs) > self.max_loras:
            raise ValueError(f"loras: {len(pairs)} adapters named; this server applies at most {self.max_loras} at "
                             f"once (--max-loras)")
        return {str(self._file(name)): scale for name, scale in pairs}

    def _file(self, name: str) -> Path:
        if not name or Path(name).is_absolute() or ".." in Path(name).parts:
            raise ValueError(f"loras: {name!r} is not an adapter name: name a file of the server's --lora-dir, "
                             f"without a path")
        for candidate in (self.folder / name, self.folder / f"{name}.safetensors"):
            real = candidate.resolve()
            if candidate.is_file():
                if self.folder not in real.parents:
                    raise ValueError(f"loras: {name!r} is a link that leaves the server's --lora-dir: refused")
                return real
        known = sorted(p.stem for p in self.folder.glob("*.safetensors") if self.folder in p.resolve().parents)
        raise ValueError(f"loras: no adapter {name!r} in the server's --lora-dir; it has: {', '.join(known) or 'none'}")

    def activate(self, pipe, loras: dict[str, float]) -> None:
        """Switch `pipe` to `loras` ({file: scale}) unless it runs them already."""
        key = tuple(sorted(loras.items()))
        if key == self.current:
            return
        inputs, size = self._kept.pop(key, None) or (None, 0)
        if inputs is None:
            inputs = pipe.adapter_inputs(loras)
            size = _nbytes(inputs)
        pipe.set_loras(loras, inputs=inputs)
        self.current, self.switches = key, self.switches + 1
        self._kept[key] = (inputs, size)
        while len(self._kept) > 1 and sum(s for _, s in self._kept.values()) > self.cache_bytes:
            self._kept.popitem(last=False)  # the least recently used; never the current one (the last)
        kept = sum(s for _, s in self._kept.values()) / 2**20
        names = ", ".join(f"{Path(f).stem}:{s:g}" for f, s in key) or "none"
        self.log(f"[serve] adapters {names}: switch {self.switches}, {len(self._kept)} sets kept in {kept:.1f} MiB")
