"""`make scale-check`: a real-size model through every stage on this machine, each stage's peak
resident memory measured from outside the process that runs it.

The stages are the user's own commands: building the random-weight model folder, `python -m
export`, then `python -m engines --precision fp16` for ONNX Runtime and for OpenVINO. Each runs as a
child process; a stage ends where the child prints that a submodule is done. The child's kernel high-water mark
(VmHWM in /proc/PID/status, file-backed pages of memory-mapped weights included) is sampled every
50 ms, read at that line and reset there (/proc/PID/clear_refs), so each submodule's export and
build gets its own peak. The disk each command wrote is what its output folder holds in files no earlier
command wrote: hard links to the export's weights are free.
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
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bench.report import machine, machine_size, with_section
from export.random_weights import RECIPE

# The lines that end a stage: "[export] transformer: 312.4 s, ..." and "[engines] transformer: ort-fp16 in ..."
_DONE = re.compile(r"^\[(export|engines)\] (\w+): (?:[\d.]+ s,|([\w-]+) in )")
_WROTE = re.compile(r"^\[engines\] wrote (.+)$")


@dataclass(frozen=True)
class Check:
    """What a model's check builds after its export, each a (target, precision, options) of `python -m
    engines`; and whether each output is deleted as soon as no later stage reads it (the model folder
    after the export, each artifact once measured, the export at the end), for models whose stages
    would not fit on the disk side by side."""

    builds: tuple = ()
    stream_disk: bool = False


# The real-size models export in fp16, which ONNX Runtime builds as fp16 only (engines/plan.py). OpenVINO
# takes its precisions as a runtime hint over the same IR (weights stored as fp16): bf16, the one a CPU
# computes in, compiles it here.
DEFAULT = Check(builds=(("ort", "fp16", ()), ("openvino", "bf16", ())))
CHECKS = {
    # FLUX.1's 12 B transformer is 24 GB in fp16: OpenVINO's IR in fp16 could not be compiled in 24 GiB,
    # nor with int8 weights (the CPU plugin's compile holds its 12 GB twice), so it gets int4 weights; and
    # the model folder, the export and an artifact (24 GB each) do not fit on a disk with 70 GB free
    # side by side.
    "flux-fullsize": Check(builds=(("ort", "fp16", ()), ("openvino", "bf16", ("--ov-weights", "int4"))),
                           stream_disk=True),
    # Z-Image-Turbo's 6.2 B transformer and Qwen3-4B (20 GB in fp16 together): OpenVINO bf16 with int8 weights,
    # as issue 55 asks (the compile's second copy of the weights is 6 GB here); outputs deleted as for Flux.
    "z-image-fullsize": Check(builds=(("ort", "fp16", ()), ("openvino", "bf16", ("--ov-weights", "int8"))),
                              stream_disk=True),
    # FLUX.2 klein 9B's transformer and Qwen3-8B (34 GB in fp16 together): OpenVINO bf16 with int4 weights, as
    # issue 56 asks; the model folder, the export and an artifact (about 30 GB each) do not fit side by side.
    "flux2-klein-fullsize": Check(builds=(("ort", "fp16", ()), ("openvino", "bf16", ("--ov-weights", "int4"))),
                                  stream_disk=True),
    # Qwen-Image's 20 B transformer and Qwen2.5-VL-7B's language model (55 GB in fp16 together) on a disk of about 77
    # GB free: the weights are drawn by the export (no model folder on disk); ONNX Runtime's graphs keep them in hard
    # links of the export's files, without fuse_qkv, whose fused copies (the attention projections and the adaLN
    # ones that read one input) would not fit beside the export; OpenVINO gets bf16 with int4 weights, as issue 57
    # asks, each submodule's export removed once read (its IR and the converter's copy would not fit beside it).
    "qwen-image-fullsize": Check(
        builds=(("ort", "fp16", ("--ort-link-weights", "--passes", "fold_constants,infer_shapes,remove_dead_nodes,"
                                 "fuse_attention")),
                ("openvino", "bf16", ("--ov-weights", "int4", "--remove-export"))),
        stream_disk=True),
    # Wan 2.1 14B's transformer (29 GB in fp16): OpenVINO bf16 with int4 weights, as issue 58 asks; outputs deleted
    # as for Flux.
    "wan-fullsize": Check(builds=(("ort", "fp16", ()), ("openvino", "bf16", ("--ov-weights", "int4"))),
                          stream_disk=True),
}


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


def run_measured(command: list[str], label: str, interval: float = 0.05, lines: list | None = None,
                 may_fail: bool = False) -> list[Stage]:
    """Run `command`, echoing its output (and appending it to `lines`); one Stage per submodule it
    reports done, named by the artifact it builds, and one for what follows the last (named `label`:
    writing the manifest, or the whole command if it reports no submodules). A command that fails
    stops the check, or with `may_fail` ends in a stage that says so (a build the machine cannot hold).

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
            if lines is not None:
                lines.append(line.rstrip("\n"))
            match = _DONE.match(line)
            if match:
                with lock:
                    try:
                        peak[0] = max(peak[0], _status_mib(child.pid, "VmHWM"))
                        _reset_peak(child.pid)
                    except (OSError, StopIteration):
                        pass
                    name = f"{match[1]} {match[2]}" + (f" ({match[3]})" if match[3] else "")
                    stages.append(Stage(name, time.perf_counter() - start, peak[0]))
                    peak[0] = 0.0
                start = time.perf_counter()
        if child.wait() and not may_fail:
            raise SystemExit(f"[scale-check] {label} failed (exit {child.returncode}); see its output above")
    except BaseException:
        child.kill()
        raise
    finally:
        done.set()
        sampler.join()
    if child.returncode:  # killed by a signal (the kernel's OOM killer: 9) or an error
        label = f"{label}: **failed** (exit {child.returncode})"
    stages.append(Stage(label, time.perf_counter() - start, peak[0]))
    return stages


def new_bytes(folder: Path, seen: set) -> int:
    """Bytes of the files under `folder` whose inodes are not in `seen` (which then holds them): a hard
    link to a file an earlier stage wrote costs nothing."""
    total = 0
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.is_symlink():
            stat = path.stat()
            if (stat.st_dev, stat.st_ino) not in seen:
                seen.add((stat.st_dev, stat.st_ino))
                total += stat.st_size
    return total


def remove(folder: Path, seen: set) -> None:
    """Delete an output folder, its files that no path outside it links to forgotten by `seen` first: the file
    system gives their inode numbers to the next stage's files, which would then count as written before."""
    inside, links = Counter(), {}
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            stat = path.stat()
            inside[(stat.st_dev, stat.st_ino)] += 1
            links[(stat.st_dev, stat.st_ino)] = stat.st_nlink
    seen.difference_update(key for key, count in inside.items() if links[key] == count)
    shutil.rmtree(folder)


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
                   help="delete each output once no later stage reads it, the build folder at the end (tens of "
                        "GB at real sizes; always so for the models whose stages do not fit on a disk together)")
    args = p.parse_args(argv)
    python, out = sys.executable, Path(args.out or f"build/{args.model}")
    check = CHECKS.get(args.model, DEFAULT)
    remove_after = args.remove_after or check.stream_disk
    t0 = time.perf_counter()
    printed: list[str] = []
    stages = run_measured([python, "-m", "export.source", args.model], "model folder (random weights)", lines=printed)
    seen: set = set()
    model_folder = Path(printed[-1])
    disk = [("model folder (random weights)", new_bytes(model_folder, seen))]
    drawn = any(model_folder.glob(f"*/{RECIPE}"))
    # --force: a check measures every stage, it never reuses an earlier run's output
    stages += run_measured([python, "-m", "export", args.model, "--out", str(out), "--force"],
                           "export: tokenizers, manifest")
    disk.append(("export", new_bytes(out / "onnx", seen)))
    if remove_after:
        remove(model_folder, seen)
    for target, precision, options in check.builds:
        printed = []
        stages += run_measured([python, "-m", "engines", str(out), "--target", target, "--precision", precision,
                                *options, "--force"], f"{target}-{precision}: tokenizers, manifest", lines=printed,
                               may_fail=True)
        wrote = [Path(m[1]) for m in map(_WROTE.match, printed) if m]
        if not wrote:  # failed: its stage says so; a build writes its artifact whole or not at all
            continue
        disk.append((wrote[-1].name, new_bytes(wrote[-1], seen)))
        if remove_after:
            remove(wrote[-1], seen)
    if remove_after:
        shutil.rmtree(out, ignore_errors=True)
    disk_rows = [f"| {name} | {size / 2**30:.2f} |" for name, size in disk]
    budget = args.budget_gib * 1024
    command = f"python -m bench.scale_check {' '.join(argv if argv is not None else sys.argv[1:])}".strip()
    over = [s for s in stages if s.peak_mib > budget]
    failed = [s for s in stages if "**failed**" in s.name]
    body = [f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} in {(time.perf_counter() - t0) / 60:.0f} min "
            f"(`make scale-check` runs it) on {machine()}: `{command}`", "",
            "Each stage is a submodule's export (trace without weights, weights streamed from the checkpoint "
            + ("or, where the model folder holds only their recipe, drawn as they are written, " if drawn else "")
            + "parity against PyTorch at two shapes), its ORT fp16 build (graph passes, writing, a session "
            "opened once) or its OpenVINO bf16 build (the IR converted, saved and compiled once for the CPU). "
            "Peak RSS is the child process's VmHWM, sampled from outside every "
            "50 ms and reset at the line that ends each stage; it counts memory-mapped weight pages too.", "",
            *_table(stages, budget), "",
            "Disk each command wrote (GiB; files hard-linked from an earlier command's are not counted again)"
            + (", each output deleted once no later stage read it" if remove_after else "") + ":", "",
            "| command | disk (GiB) |", "|---|---|", *disk_rows, "",
            f"Budget {args.budget_gib:g} GiB: " + ("every stage within it." if not over else
                                                   f"{len(over)} stage(s) over it: {', '.join(s.name for s in over)}.")
            + (f" Failed: {', '.join(s.name for s in failed)}." if failed else "")]
    report = Path(args.report)
    previous = report.read_text() if report.exists() else ""
    report.write_text(with_section(previous, f"Scale check: {args.model} on {machine_size()}", "\n".join(body)))
    print(f"[scale-check] wrote the table to {report}", flush=True)
    return 1 if over or failed else 0


if __name__ == "__main__":
    sys.exit(main())
