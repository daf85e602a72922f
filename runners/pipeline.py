"""`Pipeline.load(artifact_dir)`: read the manifest, verify the files, open every engine once,
and return the pipeline of the artifact's model family."""
from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from runners.caches import CacheConfig, StepCache, cache_graphs, merged_stats, parse_cache
from runners.call import Call, Calls
from runners.backends import backend_of, get_backend, open_session, thread_backends
from runners.adapters.lora import adapted_submodules, base_values, submodule_tables
from runners.adapters.branches import branch_factors, branch_layers
from runners.manifest import ManifestError, read_manifest
from runners.options import check_call
from runners.preview import Previews
from runners.profile import Profiler
from runners.schedulers import load_scheduler
from runners.static import check_feeds
from runners.text import TextTokenizer


FAMILIES: dict[str, type["Pipeline"]] = {}  # manifest's model.family -> its pipeline class
# vae= of Pipeline.load -> the engines that decode and encode: the artifact's VAE, or the tiny
# autoencoder exported beside it (`python -m export MODEL --tiny-vae ...`).
VAE_ENGINES = {"full": ("vae_decoder", "vae_encoder"), "tiny": ("vae_decoder_tiny", "vae_encoder_tiny")}


class Pipeline:
    family = ""
    options: tuple = ()  # the request options a call takes (runners/options.py), declared by the family's steps

    def __init_subclass__(cls, **kwargs):
        # A family module registers itself by defining its class: `load` never imports the
        # families, so they may import this module (runners/__init__.py imports them all).
        super().__init_subclass__(**kwargs)
        if cls.family:
            FAMILIES[cls.family] = cls

    @classmethod
    def load(cls, artifact_dir, *, threads: int | None = None, providers: list[str] | None = None,
             verify: bool = True, progress: bool = False, submodules: list[str] | None = None,
             device_map: dict[str, int] | None = None, loras: dict | None = None, vae: str = "full") -> "Pipeline":
        """Open an artifact folder. `threads` sets each session's intra-op threads, `providers`
        the ONNX Runtime execution providers; `verify=False` skips the sha256 check of the files;
        `submodules` opens only those engines (e.g. ["vae_decoder"] to decode latents);
        `device_map` puts TensorRT engines on GPUs ({"text_encoder_3": 1}; the rest on GPU 0);
        `loras` ({adapter path: scale}) opens the engines with those adapters (see `set_loras`);
        `vae="tiny"` decodes and encodes with the tiny autoencoder the artifact carries (and leaves the
        full VAE's engines closed)."""
        families = FAMILIES
        folder = Path(artifact_dir)
        manifest = read_manifest(folder, verify=verify)
        stage = manifest.get("stage")
        if stage != "artifact":  # the export's folder (or a calibration's) has a manifest too
            build = folder.parent if stage == "onnx" else "BUILD_DIR"
            raise ManifestError(f"{folder} is not an artifact but a {stage!r} folder: build an artifact from the "
                                f"export with `python -m engines {build}` and load {build}/ort-fp32")
        family = manifest["model"]["family"]
        if family not in families:
            raise ValueError(f"{folder}: model family {family!r} has no runner; known: {', '.join(families)}")
        unknown = set(submodules or ()) - set(manifest["submodules"])
        if unknown:
            raise ValueError(f"{folder} has no submodule {', '.join(sorted(unknown))}; "
                             f"it has: {', '.join(manifest['submodules'])}")
        check_device_map(device_map or {}, manifest["submodules"])
        submodules = _vae_submodules(folder, manifest, vae, submodules)
        backends = {get_backend(backend_of(manifest, name)) for name in submodules or manifest["submodules"]}
        if threads and not any(b.threads for b in backends):
            titles = " and ".join(sorted({b.title for b in backends}))
            raise ValueError(f"threads={threads} sets the CPU threads of {thread_backends()} sessions; every "
                             f"engine {folder} opens is {titles}'s: leave threads unset")
        return families[family](folder, manifest, threads=threads, providers=providers, progress=progress,
                                submodules=submodules, device_map=device_map, loras=loras, vae=vae)

    def __init__(self, folder: Path, manifest: dict, threads=None, providers=None, progress=False, submodules=None,
                 device_map=None, loras=None, vae="full"):
        self.folder, self.manifest = folder, manifest
        self.vae_engines = VAE_ENGINES[vae]  # (decoder, encoder)
        self.cache_config: CacheConfig | None = None  # enable_cache / disable_cache
        self.cache_stats: dict = {}  # denoiser evaluations of the last call: full, cached and their seconds
        self.device_map = dict(device_map or {})
        self.opened = list(submodules or manifest["submodules"])
        self.cache_graphs = cache_graphs(manifest)  # opened by the first call that caches with them
        self.constants = manifest["pipeline"]
        self.dims = manifest["dims"]
        self.progress = progress
        self.timings: dict[str, float] = {}  # seconds per stage of the last call
        self._calls = Calls(f"diffusion_aot.call.{id(self)}",
                            all(get_backend(backend_of(manifest, name)).concurrent for name in self.opened))
        self._session_options = {"threads": threads, "providers": providers}
        self.closed = False
        self.loras: dict = dict(loras or {})
        # Adapters reach an engine as changed weights (ONNX Runtime: {submodule: {weight: value}}), or as
        # low-rank branches beside its layers (OpenVINO: {submodule: {layer: (A, B)}}).
        self._branches = get_backend(manifest["backend"]).lora_branches
        # Adapters `python -m engines lora` gave a branch artifact: applied under every set of `loras`.
        self._baked = {folder / e["file"]: e["scale"] for e in manifest.get("lora_branches", [])}
        # An engine with branches runs its branched model while an adapter touches it, else the model as
        # built: a set of adapters gives the same images whichever sets came before it, none the plain ones.
        self._adapted, self._factors = self.adapter_inputs(self.loras)
        self.sessions = self._open_sessions()
        self.profiler: Profiler | None = None
        # Sees the inputs of every engine call: (submodule, feeds) -> None. The build's calibration
        # step records with it (engines/calibration.py).
        self.recorder = None
        self.tokenizers = {
            name: TextTokenizer(folder / t["file"], t, name)
            for name, t in manifest["tokenizers"].items()
        }
        self.scheduler = load_scheduler(json.loads((folder / manifest["scheduler"]["file"]).read_text()))

    def adapter_inputs(self, loras: dict, ignore_unmatched: bool = False) -> tuple[dict, dict]:
        """(adapted weights, branch factors) of `loras` on this artifact: one of the two is empty."""
        if self._branches:
            return {}, branch_factors(self.folder, self.manifest, {**self._baked, **loras}, ignore_unmatched)
        return adapted_submodules(self.folder, self.manifest, loras, ignore_unmatched), {}

    def _open_session(self, name: str, profile: bool = False):
        sub = self.manifest["submodules"][name]
        branches = {}
        if self._branches and sub.get("weights_file"):
            layers = branch_layers(submodule_tables(self.folder, {"submodules": {name: sub}})[name])
            branches = {"lora_layers": layers, "lora_factors": self._factors.get(name, {})}
        return open_session(backend_of(self.manifest, name), self.folder / sub["file"],
                            device=self.device_map.get(name), profile=profile, session_config=sub.get("session_config"),
                            session_options=sub.get("session_options"), initializers=self._adapted.get(name),
                            **branches, **self._session_options)

    def _open_sessions(self, profile: bool = False) -> dict:
        """The engines of `opened` but the caches' graphs, which the first call that runs one opens (`open_cache_graph`;
        a profiled call opens it profiled)."""
        sessions = {}
        try:
            for name in self.manifest["submodules"]:
                if name in self.opened and name not in self.cache_graphs:
                    sessions[name] = self._open_session(name, profile)
        except BaseException:  # the engines opened before the failing one hold device memory too
            _close_all(sessions)
            raise
        return sessions

    def open_cache_graph(self, name: str) -> None:
        """Open a cache's graph (`cache_graphs`) with the adapters in use, at the first call that runs it."""
        if name not in self.sessions:
            self.sessions[name] = self._open_session(name, profile=self.profiler is not None)

    def set_loras(self, loras: dict, ignore_unmatched: bool = False, inputs: tuple | None = None) -> None:
        """Switch to `loras` ({adapter path: scale}; {} for none) before the next call. The adapted
        weights are computed from the artifact's own each time, so switching back to an adapter gives
        exactly its images again (or given: `inputs`, what `adapter_inputs(loras)` returned, kept by
        a server that switches back and forth). Only the engines whose weights change are reopened,
        one at a time; an engine with branches (OpenVINO) is not reopened: its branches' inputs change;
        a TensorRT engine is refitted (the adapted weights, and the artifact's own where an adapter left)."""
        if self.closed:
            raise RuntimeError(f"this pipeline was closed (Pipeline.close()): load {self.folder} again")
        adapted, factors = inputs or self.adapter_inputs(dict(loras), ignore_unmatched)
        changed = (set(adapted) | set(self._adapted)) & set(self.sessions)
        for name, session in self.sessions.items():
            if getattr(session, "lora_layers", None):
                session.set_lora_factors(factors.get(name, {}))
        before, self._adapted, self._factors, self.loras = self._adapted, adapted, factors, dict(loras)
        for name in changed:
            if hasattr(self.sessions[name], "refit"):  # TensorRT: the weights change in the loaded engine
                restored = base_values(self.folder, self.manifest, name, before.get(name, {}))
                self.sessions[name].refit({**restored, **adapted.get(name, {})})
                continue
            self.sessions.pop(name).close()  # one copy of the engine's weights in memory at a time
            self.sessions[name] = self._open_session(name)

    def set_scheduler(self, config) -> None:
        """Run the next calls with another scheduler config: a dict or a scheduler_config.json path, as diffusers'
        `SchedulerClass.from_config(config)` takes it (a few-step recipe's, Qwen-Image-Lightning's). The
        artifact's own: `set_scheduler(pipe.folder / pipe.manifest["scheduler"]["file"])`."""
        if not isinstance(config, dict):
            config = json.loads(Path(config).read_text())
        config = {"_class_name": self.scheduler.config["_class_name"], **config}
        self.scheduler = load_scheduler(config)

    def close(self) -> None:
        """Free what every engine holds (TensorRT's device buffers and streams, the weights). The
        pipeline cannot run after this; `with Pipeline.load(...) as pipe:` closes it at the end."""
        sessions, self.sessions = getattr(self, "sessions", None) or {}, {}
        self.closed = True
        _close_all(sessions)

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self):  # a safety net for a pipeline dropped without close(): device memory is not garbage collected
        if getattr(self, "sessions", None):
            self.close()

    def __call__(self, *args, profile=None, cache=False, preview_every=None, on_preview=None, **kwargs):
        """Run the family's `generate`. `profile=DIR` writes a trace of every engine call, one of
        the whole run and a summary into DIR (see runners/profile.py), and prints the summary.
        `cache` (a config, its text "taylorseer:interval=3", or None for none) replaces the cache of
        `enable_cache` for this call. `on_preview(step, images)` receives the current estimate of
        the images every `preview_every` steps (runners/preview.py); `cache_stats` and
        `timings["previews"]` say what the call evaluated and what the previews cost."""
        if self.closed:
            raise RuntimeError(f"this pipeline was closed (Pipeline.close()): load {self.folder} again to run it")
        check_call(self, kwargs)  # every keyword is a declared option, of its kind (runners/options.py)
        config = self.cache_config if cache is False else self._checked_cache(cache)
        with self._calls.run(Call(config, Previews.for_call(self, preview_every, on_preview))) as call:
            try:
                if profile is None:
                    return self.generate(*args, **kwargs)
                with self._profiling(profile):
                    return self.generate(*args, **kwargs)
            finally:
                self.timings = call.timings
                self.cache_stats = merged_stats(call.step_caches.values())

    def enable_cache(self, config) -> None:
        """Cache denoiser evaluations in every later call (diffusers' `enable_cache`): a config such as
        `TaylorSeerCacheConfig(...)` or its text ("taylorseer:interval=3,before=6"). Each call starts
        the cache afresh."""
        self.cache_config = self._checked_cache(config)

    def disable_cache(self) -> None:
        """Every evaluation in full again: the next call gives exactly the uncached image."""
        self.cache_config = None

    def _checked_cache(self, config) -> CacheConfig | None:
        config = parse_cache(config) if isinstance(config, str) else config
        if config is not None and not isinstance(config, CacheConfig):
            raise ValueError(f"cache={config!r:.60} is not a cache config: pass TaylorSeerCacheConfig(...), its text "
                             "(\"taylorseer:interval=3\") or None")
        if config is not None:
            config.check(self.manifest)
        return config

    def _evaluate(self, step: int, num_steps: int, x, t, conditions: dict, context: str = "batch",
                  engine: str | None = None) -> np.ndarray:
        """The denoiser's prediction at `step` of `num_steps` for latents `x` at timestep `t`: the family's
        `_predict` in full, or the running call's cache's answer. Every denoising loop calls the
        denoiser through this (`context` as diffusers' cache_context: one name per stream of
        evaluations a step makes, "cond" and "uncond" when guidance runs them apart); `engine`: another denoiser
        graph of the same inputs (a handover's: runners/text_to_image.py), with a cache of its own, as diffusers'
        hooks on each transformer: `step` and `num_steps` count that denoiser's steps."""
        call = self._calls.current
        if engine not in call.step_caches:
            config = call.cache_config
            call.step_caches[engine] = config.start(self, num_steps, engine) if config else StepCache(self, num_steps)
        last = step == num_steps - 1  # the engine's working memory is released after the last step (or
        # after the last that runs in full, when the cache knows it: `run_full(release=True)`)
        return call.step_caches[engine](step, context, (x, t, conditions),
                                        lambda release=last: self._predict(x, t, conditions, release=release,
                                                                           engine=engine)["noise_pred"])

    @contextmanager
    def _profiling(self, out_dir):
        """Sessions that record ONNX Runtime's operator profile for this run, then the usual ones back."""
        _close_all(self.sessions)  # one set of engines in memory at a time (on a GPU, in device memory)
        try:
            self.sessions = self._open_sessions(profile=True)
            self.profiler = Profiler(out_dir, self.constants["denoiser"])
            yield
            ort_events = {name: s.end_profiling() for name, s in self.sessions.items()
                          if hasattr(s, "end_profiling")}
            print(self.profiler.finish(ort_events), flush=True)
        finally:
            self.profiler = None
            _close_all(self.sessions)
            self.sessions = self._open_sessions()

    def generate(self, *args, **kwargs):
        raise NotImplementedError

    def run(self, submodule: str, release: bool = True, **feeds):
        """One engine call. `release` (default) frees its working memory afterwards; the denoising
        loop keeps it between steps and releases it after the last one."""
        if self.closed:
            raise RuntimeError(f"this pipeline was closed (Pipeline.close()): load {self.folder} again to run it")
        check_feeds(submodule, self.manifest["submodules"][submodule], feeds)
        session = self.sessions[submodule]
        if self.recorder is not None:
            self.recorder(submodule, feeds)
        if self.profiler is None:
            return session.run(feeds, release=release)
        return self.profiler.call(submodule, lambda: session.run(feeds, release=release))

    @contextmanager
    def _timed(self, stage: str):
        t0 = time.perf_counter()
        yield
        timings = self._calls.current.timings
        timings[stage] = timings.get(stage, 0.0) + time.perf_counter() - t0

    def _progress(self, i: int, n: int, what: str = "denoising") -> None:
        # A redrawn bar on a terminal; only the final line in a log file.
        if self.progress and (sys.stderr.isatty() or i == n):
            bar = "#" * (30 * i // n)
            end = "\n" if i == n else ""
            print(f"\r{what} [{bar:<30}] {i}/{n}", end=end, file=sys.stderr, flush=True)


def _vae_submodules(folder, manifest: dict, vae: str, submodules: list[str] | None) -> list[str] | None:
    """The engines to open for `vae`: "tiny" needs the tiny autoencoder and leaves the full VAE's closed."""
    if vae not in VAE_ENGINES:
        raise ValueError(f"vae={vae!r} is not allowed: use one of {', '.join(VAE_ENGINES)}")
    if vae == "full":
        return submodules
    if VAE_ENGINES["tiny"][0] not in manifest["submodules"]:
        raise ValueError(f"vae='tiny': {folder} has no tiny autoencoder; export the model with "
                         "`python -m export MODEL --tiny-vae FOLDER_OR_HUB_ID` and build it again")
    return [s for s in submodules or manifest["submodules"] if s not in VAE_ENGINES["full"]]


def _close_all(sessions: dict) -> None:
    for session in sessions.values():
        session.close()
    sessions.clear()


def parse_device_map(text: str) -> dict[str, int]:
    """"text_encoder_3=1,transformer=0" -> {"text_encoder_3": 1, "transformer": 0}."""
    device_map = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, device = item.partition("=")
        if not sep or not device.strip().isdigit():
            raise ValueError(f"device map entry {item!r} is not SUBMODULE=GPU_INDEX (e.g. text_encoder_3=1)")
        device_map[name.strip()] = int(device)
    return device_map


def check_device_map(device_map: dict, submodules) -> None:
    unknown = sorted(set(device_map) - set(submodules))
    if unknown:
        raise ValueError(f"device map names {', '.join(unknown)}, which this artifact does not have; "
                         f"it has: {', '.join(submodules)}")
    bad = {k: v for k, v in device_map.items() if not isinstance(v, int) or isinstance(v, bool) or v < 0}
    if bad:
        raise ValueError(f"device map: GPU indices are integers from 0; got {bad}")
