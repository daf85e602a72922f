"""`make scale-check`: a real-size model through every stage on this machine, each stage's peak
resident memory measured from outside the process that runs it.

The stages are the user's own commands: building the random-weight model folder, `python -m
export` and `python -m engines --target ort --precision fp16`. Each runs as a child process; a
stage ends where the child prints that a submodule is done. The child's kernel high-water mark
(VmHWM in /proc/PID/status, file-backed pages of memory-mapped weights included) is sampled every
50 ms, read at that line and reset there (/proc/PID/clear_refs), so each submodule's export and
build gets its own peak.
The table goes into BENCHMARKS.md under the command that produced it; the check fails when a
stage goes over the budget.

    python -m bench.scale_check --model sd3-fullsize --budget-gib 16
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.report import machine, machine_size, with_section

# The lines that end a stage: "[export] transformer: 312.4 s, ..." and "[engines] transformer: ort-fp16 in ..."
_DONE = re.compile(r"^\[(export|engines)\] (\w+): (?:[\d.]+ s,|\w+-\w+ in )")


@dataclass
class Stage:
    name: str
    seconds: float
    peak_mib: float


def _status_mib(pid: int, key: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key + ":"))


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def run_measured(command: list[str], label: str, interval: float = 0.05) -> list[Stage]:
    """Run `command`, echoing its output; one Stage per submodule it reports done, and one for
    what follows the last (named `label`: writing the manifest, or the whole command if it
    reports no submodules).

    The child's high-water mark is sampled every `interval` seconds and the largest kept per
    stage: the export resets its own mark as it starts each submodule (for the manifest's
    figures), which can happen before this process has read the line that ended the last one."""
    print(f"[scale-check] $ {' '.join(command)}", flush=True)
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    peak, lock, done = [0.0], threading.Lock(), threading.Event()

    def sample():
        while not done.wait(interval):
            try:
                mark = _status_mib(child.pid, "VmHWM")
            except (OSError, StopIteration):  # exited: its last samples stand
                continue
            with lock:
                peak[0] = max(peak[0], mark)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stages, start = [], time.perf_counter()
    try:
        for line in child.stdout:
            sys.stdout.write(line)
            match = _DONE.match(line)
            if match:
                with lock:
                    try:
                        peak[0] = max(peak[0], _status_mib(child.pid, "VmHWM"))
                        _reset_peak(child.pid)
                    except (OSError, StopIteration):
                        pass
                    stages.append(Stage(f"{match[1]} {match[2]}", time.perf_counter() - start, peak[0]))
                    peak[0] = 0.0
                start = time.perf_counter()
        if child.wait():
            raise SystemExit(f"[scale-check] {label} failed (exit {child.returncode}); see its output above")
    except BaseException:
        child.kill()
        raise
    finally:
        done.set()
        sampler.join()
    stages.append(Stage(label, time.perf_counter() - start, peak[0]))
    return stages


def _table(stages: list[Stage], budget_mib: float) -> list[str]:
    rows = ["| stage | seconds | peak RSS (GiB) | within budget |", "|---|---|---|---|"]
    rows += [f"| {s.name} | {s.seconds:.0f} | {s.peak_mib / 1024:.2f} | {'yes' if s.peak_mib <= budget_mib else '**no**'} |"
             for s in stages]
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="sd3-fullsize")
    p.add_argument("--budget-gib", type=float, default=16.0, help="the peak RSS every stage must stay under")
    p.add_argument("--out", default=None, help="build folder (default build/MODEL)")
    p.add_argument("--report", default="BENCHMARKS.md")
    p.add_argument("--remove-after", action="store_true",
                   help="delete the build folder afterwards (tens of GB at real sizes)")
    args = p.parse_args(argv)
    python, out = sys.executable, Path(args.out or f"build/{args.model}")
    t0 = time.perf_counter()
    stages = run_measured([python, "-m", "export.source", args.model], "model folder (random weights)")
    # --force: a check measures every stage, it never reuses an earlier run's output
    stages += run_measured([python, "-m", "export", args.model, "--out", str(out), "--force"],
                           "export: tokenizers, manifest")
    stages += run_measured([python, "-m", "engines", str(out), "--target", "ort", "--precision", "fp16", "--force"],
                           "engines: tokenizers, manifest")
    budget = args.budget_gib * 1024
    command = f"python -m bench.scale_check {' '.join(argv if argv is not None else sys.argv[1:])}".strip()
    over = [s for s in stages if s.peak_mib > budget]
    body = [f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} in {(time.perf_counter() - t0) / 60:.0f} min "
            f"(`make scale-check` runs it) on {machine()}: `{command}`", "",
            "Each stage is a submodule's export (trace without weights, weights streamed from the checkpoint, "
            "parity against PyTorch at two shapes) or its ORT fp16 build (graph passes, writing, a session "
            "opened once). Peak RSS is the child process's VmHWM, sampled from outside every 50 ms and reset "
            "at the line that ends each stage; it counts memory-mapped weight pages too.", "",
            *_table(stages, budget), "",
            f"Budget {args.budget_gib:g} GiB: " + ("every stage within it." if not over else
                                                   f"{len(over)} stage(s) over it: {', '.join(s.name for s in over)}.")]
    report = Path(args.report)
    previous = report.read_text() if report.exists() else ""
    report.write_text(with_section(previous, f"Scale check: {args.model} on {machine_size()}", "\n".join(body)))
    print(f"[scale-check] wrote the table to {report}", flush=True)
    if args.remove_after:
        shutil.rmtree(out, ignore_errors=True)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
