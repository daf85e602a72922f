"""python -m bench: time diffusers, Optimum-ONNX and our artifacts on the same workload, with the
same weights and starting latents, and write BENCHMARKS.md. Each table is a module of
bench/tables/; `--tables` alone lists them."""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from bench import accuracy, gemm
from bench.tables import TABLES, for_family, listing


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--model", default="sd3-bench")
    p.add_argument("--tables", nargs="?", const="", default=None,
                   help="comma-separated tables to measure (default: every table of the model's family); the other "
                        "tables already in --out are kept as they are, each with the command that produced it. "
                        "Without a value: list the tables")
    p.add_argument("--list-tables", action="store_true", help="list the tables, their families and what they build")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--size", type=int, default=512, help="image side of the tables' calls and runs")
    p.add_argument("--steps", type=int, default=28, help="steps of the end-to-end runs at --size (0: skip them)")
    p.add_argument("--gemm-size", type=int, default=gemm.N,
                   help="side of the square fp32 GEMM whose rate is the FLOP bound (smaller: a rougher bound)")
    p.add_argument("--out", default="BENCHMARKS.md")
    p.add_argument("--build-dir", default="build", help="where the model's export and artifacts are built (cached)")
    peers = p.add_argument_group("peers on the same weights")
    peers.add_argument("--compile", action="store_true", help="add (b) diffusers + torch.compile (compiles for minutes)")
    peers.add_argument("--optimum-python", default=None,
                       help="python of an environment with optimum-onnx (make optimum-venv): adds (c)")
    accuracy.add_arguments(p)
    for table in TABLES.values():
        if table.arguments:
            table.arguments(p.add_argument_group(f"{table.name} table"))
    args = p.parse_args(argv)
    if args.tables is not None:
        args.tables = [t for t in args.tables.split(",") if t]
        unknown = [t for t in args.tables if t not in TABLES]
        if unknown:
            p.error(f"unknown table {', '.join(unknown)}: choose from {', '.join(TABLES)}")
    return args


def _selected(args: argparse.Namespace, family: str) -> list[str]:
    """The tables named by --tables, or every table of `family`; a named table of another family is
    refused (for a registry model before the minutes of preparation, for a folder once it is read)."""
    applies = for_family(family)
    if args.tables is None:
        return applies
    wrong = [t for t in args.tables if t not in applies]
    if wrong:
        raise SystemExit(f"python -m bench: table {', '.join(wrong)} does not apply to {args.model} (family "
                         f"{family}): its tables are {', '.join(applies)}")
    return args.tables


def _cpu_seconds() -> float:
    """User and system CPU of this process and its ended children (workers, builds): what each table costs
    on a loaded machine, where wall time says little."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main(argv: list[str] | None = None) -> int:
    from bench.harness import log
    from bench.report import write
    from bench.run import prepare
    from export.registry import MODELS

    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    if args.list_tables or args.tables == []:
        print(listing())
        return 0
    started = time.perf_counter()
    if args.model in MODELS:
        _selected(args, MODELS[args.model].family)
    run = prepare(args)
    names = _selected(args, run.src.family.name)
    tables = []
    for name in names:
        log(f"table {name} ({time.perf_counter() - started:.0f} s in, {_cpu_seconds():.0f} s of CPU)")
        tables += TABLES[name].measure(run)
    log(f"tables done ({time.perf_counter() - started:.0f} s in, {_cpu_seconds():.0f} s of CPU)")
    command = "python -m bench " + " ".join(map(shlex.quote, argv))
    write(Path(args.out), run, tables, command, (time.perf_counter() - started) / 60)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
