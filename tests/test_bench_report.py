"""BENCHMARKS.md: a run replaces the tables it measured and keeps the others, each under the
command that produced it."""
from __future__ import annotations

from bench.report import render


def _report(command: str, title: str, value: str) -> dict:
    return {"command": command, "model": "m", "description": "d", "versions": {}, "reps": 3,
            "gemm": {"numpy": 100.0}, "notes": ["took 1 minute"],
            "tables": [{"title": title, "columns": ["a"], "rows": [[value]], "notes": [f"note {value}"]}]}


def test_a_run_keeps_the_tables_it_did_not_measure():
    first = render(_report("python -m bench --tables e2e", "End to end", "11"))
    second = render(_report("python -m bench --tables passes", "Passes", "22"), first)
    assert second.count("## End to end") == 1 and "| 11 |" in second and "note 11" in second
    assert "| 22 |" in second
    end_to_end = second.split("## End to end")[1].split("## ")[0]
    assert "--tables e2e" in end_to_end and "--tables passes" not in end_to_end
    third = render(_report("python -m bench --tables passes", "Passes", "33"), second)
    assert "| 22 |" not in third and "| 33 |" in third and "| 11 |" in third
    assert third.count("## Run notes") == 1


def test_an_earlier_one_command_file_keeps_its_command_per_table():
    old = "# Benchmarks\n\nCommand: `python -m bench --reps 3`\n\n## End to end\n\n| a |\n|---|\n| 11 |\n"
    new = render(_report("python -m bench --tables passes", "Passes", "22"), old)
    end_to_end = new.split("## End to end")[1].split("## ")[0]
    assert "Measured by an earlier run: `python -m bench --reps 3`" in end_to_end
