"""Run every variant as its own worker process and interleave their repetitions (A B A B ...),
so drift on the machine hits all variants alike. Ratios against the reference variant are
taken pair by pair, repetition by repetition."""
from __future__ import annotations

import concurrent.futures
import functools
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.worker import MARK

REPO = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


class WorkerDied(RuntimeError):
    """A variant's process ended mid-job (e.g. killed out of memory): recorded, not fatal."""


def in_child(fn, *args):
    """fn(*args) in a fresh process, returning its result: a measurement's (its process holds only what it
    imports), or any step whose memory must not stay in the parent. Preparation (export, builds, passes)
    leaves gigabytes of freed-but-kept heap in whichever process ran it; the parent, which then holds every
    worker's pipe while they measure, must stay small."""
    return _run(multiprocessing.get_context("spawn"), fn, args)


def in_prepared_child(fn, *args):
    """`in_child` for preparation (exports, builds, passes): the process is forked from one that imported the
    exporter and the engines once for the whole run, where each fresh process took seconds to import them
    again. Not for measurements: such a process starts with those modules' memory."""
    return _run(_preparation(), fn, args)


@functools.cache
def _preparation():
    if "forkserver" not in multiprocessing.get_all_start_methods():  # Windows
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["export.api", "engines.api"])
    return context


def _run(context, fn, args):
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(fn, *args).result()


@dataclass
class Variant:
    label: str  # "(a) diffusers eager"
    kind: str  # bench.variants.make_variant kind
    path: str  # pipeline folder or artifact folder
    python: str = sys.executable  # a variant may live in a virtual environment of its own
    options: dict = field(default_factory=dict)  # keyword arguments of its constructor (bench.variants)


@dataclass
class Worker:
    variant: Variant
    proc: subprocess.Popen = field(repr=False)

    @classmethod
    def start(cls, variant: Variant, constants: dict) -> "Worker":
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen([variant.python, "-m", "bench.worker", variant.kind, variant.path,
                                 json.dumps(constants), json.dumps(variant.options)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env=env, cwd=REPO)
        worker = cls(variant, proc)
        worker.read()  # loaded
        return worker

    def ask(self, job: dict) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        code = self.proc.wait()
        raise WorkerDied(f"{self.variant.label}: worker exited with code {code}"
                         + (" (killed: out of memory on this machine)" if code == -9 else ""))

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


@contextmanager
def running(variants: list[Variant], constants: dict, log):
    """One loaded worker per variant, all alive for the jobs in the block."""
    workers = []
    try:
        for v in variants:
            log(f"starting {v.label}")
            workers.append(Worker.start(v, constants))
        yield workers
    finally:
        for w in workers:
            w.stop()


def interleaved(workers: list[Worker], job: dict, reps: int, log, warmup: bool = True) -> dict[str, list]:
    """`reps` results per worker, taken in turn (A B A B ...), after one dropped warm-up round."""
    samples = {w.variant.label: [] for w in workers}
    for rep in range(-1 if warmup else 0, reps):
        for w in workers:
            result = w.ask(job)
            if rep >= 0:
                samples[w.variant.label].append(result)
        log(f"{job['job']} {job['height']}x{job['width']}: " + ("warm-up" if rep < 0 else f"{rep + 1}/{reps}"))
    return samples


def peak_rss(workers: list[Worker]) -> dict[str, float]:
    return {w.variant.label: w.ask({"job": "peak_rss", "height": 0, "width": 0})["peak_rss_mib"] for w in workers}


def interleaved_fresh(variants: list[Variant], constants: dict, job: dict | list[dict], reps: int, log,
                      warmup: bool = False) -> tuple[dict, dict, dict]:
    """Like `interleaved`, but each result comes from a fresh process that is stopped before the
    next starts: for workloads whose pipelines cannot share the machine's memory. The runs are
    cold unless `warmup` (then each process answers the job once untimed first), alike for every
    variant. A variant whose process dies is not run again. A list of jobs is answered in order by
    the same process, and its sample is the list of their results.
    Returns the samples, each variant's largest peak RSS, and the failures by variant."""
    jobs = job if isinstance(job, list) else [job]
    samples = {v.label: [] for v in variants}
    peaks = {v.label: 0.0 for v in variants}
    failed: dict[str, str] = {}
    for rep in range(reps):
        for v in variants:
            if v.label in failed:
                continue
            try:
                with running([v], constants, log) as (w,):
                    if warmup:
                        for j in jobs:
                            w.ask(j)
                    results = [w.ask(j) for j in jobs]
                    samples[v.label].append(results if isinstance(job, list) else results[0])
                    peaks[v.label] = max(peaks[v.label], peak_rss([w])[v.label])
            except WorkerDied as e:
                log(str(e))
                failed[v.label] = str(e)
        log(f"{'+'.join(j['job'] for j in jobs)} {jobs[0]['height']}x{jobs[0]['width']}: {rep + 1}/{reps} "
            "(fresh processes)")
    return samples, peaks, failed


def timed_calls(runs: dict, reps: int) -> dict[str, list[float]]:
    """{label: seconds of each of `reps` calls} of `runs` ({label: call}) in this process, after one warm-up
    each, interleaved so that drift in the machine's speed reaches every one alike."""
    for call in runs.values():
        call()
    times = {label: [] for label in runs}
    for _ in range(reps):
        for label, call in runs.items():
            t0 = time.perf_counter()
            call()
            times[label].append(time.perf_counter() - t0)
    return times


GRAPH_CALLS = 3


def graph_calls(path: str, entry: dict, inputs: dict, zeros: tuple[str, ...]) -> list[float]:
    """In a fresh process: GRAPH_CALLS timed calls of one ONNX Runtime graph after a warm-up,
    with `entry`'s session settings, on inputs made from `inputs` (`zeros`: those fed zeros)."""
    import numpy as np

    from bench.workload import make_inputs
    from runners.backends.ort import OrtSession

    feeds = make_inputs({"graph": inputs})["graph"]
    feeds.update({n: np.zeros_like(feeds[n]) for n in zeros})
    session = OrtSession(path, session_config=entry.get("session_config"),
                         session_options=entry.get("session_options"))
    return timed_calls({"call": lambda: session.run(feeds)}, GRAPH_CALLS)["call"]


def alternating_graph_calls(graphs: dict[str, Path], entry: dict, inputs: dict, reps: int,
                            zeros: tuple[str, ...] = ()) -> dict[str, list[float]]:
    """{key: seconds of each call} of each of `graphs` ({key: path}): GRAPH_CALLS calls in each of
    `reps` fresh processes per graph, one process at a time, the graphs alternating. Two sessions of one
    process, called in turn, measured a graph 12% slower where a profile of each alone found 0.6%."""
    times = {key: [] for key in graphs}
    for _ in range(reps):
        for key, path in graphs.items():
            times[key] += in_child(graph_calls, str(path), entry, inputs, tuple(zeros))
    return times


@dataclass
class Stat:
    median: float
    ratio: float | None = None  # reference time / this time: > 1 is faster than the reference
    ratio_lo: float | None = None
    ratio_hi: float | None = None

    def ratio_text(self) -> str:
        if self.ratio is None:
            return "- (no reference samples)"
        return f"{self.ratio:.2f}x [{self.ratio_lo:.2f}-{self.ratio_hi:.2f}]"


def stats(times: list[float], reference: list[float] | None) -> Stat:
    s = Stat(statistics.median(times))
    if reference is not None:
        ratios = [r / t for r, t in zip(reference, times)]
        s.ratio, s.ratio_lo, s.ratio_hi = statistics.median(ratios), min(ratios), max(ratios)
    return s


def against_first(variants: list[Variant], samples: dict, key) -> list[tuple[Variant, Stat, str]]:
    """(variant, Stat, ratio text) for each variant, the first one being the reference."""
    ref = [key(s) for s in samples[variants[0].label]]
    out = []
    for v in variants:
        first = v is variants[0]
        st = stats([key(s) for s in samples[v.label]], None if first else ref)
        out.append((v, st, "1 (reference)" if first else st.ratio_text()))
    return out
