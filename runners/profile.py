"""Profiling a run: one Chrome trace-event file per engine call, one for the whole run, and a
summary table.

Every engine call of the run is an event on its submodule's track, in call order. With the ORT
backend, ONNX Runtime's own per-operator events for that call are placed inside it: ORT profiles
a whole session, so its events are cut at each `model_run` and shifted onto our clock. The files
open in Perfetto (ui.perfetto.dev) and chrome://tracing.
"""
from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from pathlib import Path

PID = 1


def _now_us() -> float:
    return time.perf_counter() * 1e6


class Profiler:
    def __init__(self, out_dir, denoiser: str):
        self.dir = Path(out_dir)
        self.denoiser = denoiser  # its calls are labelled as steps
        self.calls: list[dict] = []  # in call order: {"submodule", "label", "ts", "dur"}
        self._count: Counter = Counter()
        self.t0 = _now_us()
        self.end = None

    def call(self, submodule: str, fn):
        i = self._count[submodule]
        self._count[submodule] += 1
        label = f"{submodule}.step{i:02d}" if submodule == self.denoiser else f"{submodule}.call{i}"
        start = _now_us()
        result = fn()
        self.calls.append({"submodule": submodule, "label": label, "ts": start - self.t0, "dur": _now_us() - start})
        return result

    def finish(self, ort_events: dict[str, list[dict]]) -> str:
        """Write the traces (`ort_events`: each session's ONNX Runtime profile, by submodule) and
        return the summary table."""
        self.end = _now_us() - self.t0
        tracks = {s: i + 1 for i, s in enumerate(dict.fromkeys(c["submodule"] for c in self.calls))}
        ops = _ops_per_call(self.calls, ort_events)
        self.dir.mkdir(parents=True, exist_ok=True)
        everything = [{"ph": "M", "pid": PID, "tid": tid, "name": "thread_name", "args": {"name": s}}
                      for s, tid in tracks.items()]
        everything.append({"ph": "X", "pid": PID, "tid": 0, "name": "pipeline", "ts": 0.0, "dur": self.end,
                           "cat": "run"})
        for call, call_ops in zip(self.calls, ops):
            tid = tracks[call["submodule"]]
            events = [{"ph": "X", "pid": PID, "tid": tid, "name": call["label"], "ts": call["ts"],
                       "dur": call["dur"], "cat": "call"}]
            events += [{**op, "pid": PID, "tid": tid} for op in call_ops]
            _write(self.dir / f"{call['label']}.json", events)
            everything += events
        _write(self.dir / "trace.json", everything)
        summary = self.summary(ops)
        (self.dir / "summary.txt").write_text(summary + "\n")
        return summary

    def summary(self, ops: list[list[dict]]) -> str:
        per = defaultdict(list)
        for call in self.calls:
            per[call["submodule"]].append(call["dur"])
        lines = [f"profile: {len(self.calls)} engine calls in {self.end / 1e6:.2f} s end to end, written to {self.dir}",
                 f"{'submodule':<16} {'calls':>5} {'total ms':>10} {'mean ms':>9} {'share':>7}"]
        for sub, durs in per.items():
            lines.append(f"{sub:<16} {len(durs):>5} {sum(durs) / 1e3:>10.1f} {sum(durs) / len(durs) / 1e3:>9.1f} "
                         f"{100 * sum(durs) / self.end:>6.1f}%")
        by_op = Counter()
        for call_ops in ops:
            for op in call_ops:
                by_op[op["args"]["op_name"]] += op["dur"]
        if by_op:
            total = sum(by_op.values())
            lines.append(f"{'operator':<28} {'total ms':>10} {'share of op time':>17}")
            lines += [f"{op:<28} {d / 1e3:>10.1f} {100 * d / total:>16.1f}%" for op, d in by_op.most_common(10)]
        return "\n".join(lines)


def ort_runs(events: list[dict]) -> list[tuple[dict, list[dict]]]:
    """An ONNX Runtime session profile cut into its runs, in order: each `model_run` event with
    the kernel events inside it."""
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    kernels = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    return [(run, [e for e in kernels if run["ts"] <= e["ts"] <= run["ts"] + run["dur"]]) for run in runs]


def _ops_per_call(calls: list[dict], ort_events: dict[str, list[dict]]) -> list[list[dict]]:
    """Each call's ONNX Runtime kernel events, moved onto our clock and centred inside the call."""
    runs = {s: iter(ort_runs(evs)) for s, evs in ort_events.items()}
    out = []
    for call in calls:
        run, inside = next(runs[call["submodule"]], (None, [])) if call["submodule"] in runs else (None, [])
        if run is None:
            out.append([])
            continue
        shift = call["ts"] + max(0.0, call["dur"] - run["dur"]) / 2 - run["ts"]
        out.append([{"ph": "X", "name": e["name"][: -len("_kernel_time")], "ts": e["ts"] + shift,
                     "dur": min(e["dur"], run["ts"] + run["dur"] - e["ts"]), "cat": "op",
                     "args": {"op_name": e["args"].get("op_name", "?")}} for e in inside])
    return out


def _write(path: Path, events: list[dict]) -> None:
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
