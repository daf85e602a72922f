"""`Pipeline.load(artifact_dir)`: read the manifest, verify the files, open every engine once,
and return the pipeline of the artifact's model family."""
from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from runners.backends import open_session
from runners.manifest import read_manifest
from runners.scheduler import load_scheduler
from runners.text import TextTokenizer


class Pipeline:
    family = ""

    @classmethod
    def load(cls, artifact_dir, *, threads: int | None = None, providers: list[str] | None = None,
             verify: bool = True, progress: bool = False) -> "Pipeline":
        """Open an artifact folder. `threads` sets each session's intra-op threads, `providers`
        the ONNX Runtime execution providers; `verify=False` skips the sha256 check of the files."""
        from runners.sd3 import SD3Pipeline

        families = {p.family: p for p in (SD3Pipeline,)}
        folder = Path(artifact_dir)
        manifest = read_manifest(folder, verify=verify)
        family = manifest["model"]["family"]
        if family not in families:
            raise ValueError(f"{folder}: model family {family!r} has no runner; known: {', '.join(families)}")
        return families[family](folder, manifest, threads=threads, providers=providers, progress=progress)

    def __init__(self, folder: Path, manifest: dict, threads=None, providers=None, progress=False):
        self.folder, self.manifest = folder, manifest
        self.constants = manifest["pipeline"]
        self.dims = manifest["dims"]
        self.progress = progress
        self.timings: dict[str, float] = {}  # seconds per stage of the last call
        self.sessions = {
            name: open_session(manifest["target"], folder / sub["file"], threads=threads, providers=providers)
            for name, sub in manifest["submodules"].items()
        }
        self.tokenizers = {
            name: TextTokenizer(folder / t["file"], t["pad_token_id"], name)
            for name, t in manifest["tokenizers"].items()
        }
        self.scheduler = load_scheduler(json.loads((folder / manifest["scheduler"]["file"]).read_text()))

    def run(self, submodule: str, release: bool = True, **feeds):
        """One engine call. `release` (default) frees its working memory afterwards; the denoising
        loop keeps it between steps and releases it after the last one."""
        return self.sessions[submodule].run(feeds, release=release)

    @contextmanager
    def _timed(self, stage: str):
        t0 = time.perf_counter()
        yield
        self.timings[stage] = self.timings.get(stage, 0.0) + time.perf_counter() - t0

    def _progress(self, i: int, n: int) -> None:
        # A redrawn bar on a terminal; only the final line in a log file.
        if self.progress and (sys.stderr.isatty() or i == n):
            bar = "#" * (30 * i // n)
            end = "\n" if i == n else ""
            print(f"\rdenoising [{bar:<30}] {i}/{n}", end=end, file=sys.stderr, flush=True)
