"""Runtime backends by name: each opens one engine file as a session whose
`run(feeds, release=False)` maps input names to numpy arrays and returns the outputs by name;
`release` frees the call's working memory when a stage is done; `close()` frees everything the
session holds (device buffers, streams, weights), after which it is not used again.

Who owns an output: the session, until its next `run`. A backend may return views of buffers it
reuses (polygraphy's TrtRunner resizes and refills one host buffer per output on every call), so a
caller that keeps an output past the session's next call copies it. The pipeline does so exactly
where it keeps one: the tiles of a tiled VAE, PLMS's past noise predictions, and what `vae_decode`
and `vae_encode` hand back (tests/test_output_ownership.py drives every path with such a backend).

The registry mirrors engines/targets: every module of this package lists its backends in `BACKENDS`,
an engines target names the backend that opens its engines, and the artifact's manifest records it
(`backend`, per submodule where one differs: `--fallback ort`, a native Triton repository's BLS calls).
Adding a backend is one module here; nothing else names it."""
from __future__ import annotations

import importlib
import os
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Backend:
    name: str
    title: str  # what its engines are called in errors ("ONNX Runtime")
    # (path, device, **options) -> session. options: threads, providers, profile, session_config,
    # session_options (the manifest's, per submodule) and initializers (adapters' weights).
    open: Callable[..., Any]
    gpu: bool = False  # its engines run on NVIDIA GPUs: a device map places them, Triton gives them GPU instances
    threads: bool = False  # takes the pipeline's CPU `threads`
    adapters: bool = False  # takes `initializers`, so that adapters switch at run time (runners/adapters/lora.py)
    # takes adapters as low-rank branches instead (`lora_layers`, `lora_factors`, session.set_lora_factors:
    # runners/adapters/branches.py), so that a switch changes the branches' inputs and reopens nothing
    lora_branches: bool = False
    triton: str | None = None  # the config.pbtxt line of Triton's own backend for its engines (native layout)
    device_hint: str = ""  # how its engines' device is chosen instead, said when a device map names one
    # Two threads may run its sessions at once (ONNX Runtime's run is thread-safe); else a pipeline's calls wait
    # for each other (one OpenVINO infer request per engine; TensorRT's reused device and output buffers)
    concurrent: bool = False


THREADS_VARIABLE = "DIFFUSION_AOT_THREADS"


def cpu_threads(threads: int | None) -> int | None:
    """The CPU threads of one ONNX Runtime or OpenVINO session: `threads` when given, else
    $DIFFUSION_AOT_THREADS, else None (the runtime's default: every core). For processes that share one
    machine's cores (server instances, the test suite's workers): two sessions with a thread per core
    each, on the same cores, spin against each other (ONNX Runtime's tiny-model steps took twice as long)."""
    if threads:
        return threads
    value = os.environ.get(THREADS_VARIABLE, "")
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{THREADS_VARIABLE}={value!r}: give a number of threads, 1 or more (or unset it: every core)")
    return int(value)


def registry() -> dict[str, Backend]:
    """{name: backend} of every module of this package (a module whose name starts with '_' is a helper)."""
    backends = {}
    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_"):
            backends.update((b.name, b) for b in importlib.import_module(f"{__name__}.{module.name}").BACKENDS)
    return backends


def get_backend(name: str) -> Backend:
    backends = registry()
    if name not in backends:
        raise ValueError(f"this runner has no backend '{name}'; it runs: {', '.join(backends)} (an older artifact's "
                         "manifest holds its backend's version there: build it again with python -m engines)")
    return backends[name]


def backend_of(manifest: dict, submodule: str) -> str:
    """The backend that opens `submodule`'s engine: its own (a fallback's, BLS's), else the artifact's."""
    return manifest["submodules"][submodule].get("backend", manifest["backend"])


def _titles(keep: Callable[[Backend], bool]) -> str:
    return " and ".join(sorted({b.title for b in registry().values() if keep(b)}))


def open_session(backend: str, path, device: int | None = None, **options):
    """`device`: the GPU an engine of a GPU backend runs on (a device map's entry; default 0).
    `initializers` ({name: array}) replace weights of the graph, where the backend takes them: adapters."""
    chosen = get_backend(backend)
    if options.get("initializers") and not chosen.adapters:
        raise ValueError(f"{path}: adapters switch at run time on {_titles(lambda b: b.adapters or b.lora_branches)} "
                         f"engines; this engine runs on {chosen.title} (apply them with `python -m engines lora` "
                         f"to an ONNX Runtime artifact)")
    if device is not None and not chosen.gpu:
        raise ValueError(f"{path}: a device map places {_titles(lambda b: b.gpu)} engines; this engine runs on "
                         f"{chosen.title}{chosen.device_hint}")
    return chosen.open(path, device=device, **options)


def thread_backends() -> str:
    """The backends `threads` sets, as a sentence names them."""
    return _titles(lambda b: b.threads)
