"""Every `python -m ...` and `make ...` command that README.md and docs/*.md quote still parses.

A `python -m X ...` command goes through X's real argparse parser, stopped right after it parses
(nothing runs): an unknown flag, a missing required value or a bad choice fails here, not for the
reader. A command that elides its middle (`python -m runners ... --vae-tiling`) is checked flag by
flag against the options of that parser, and inline code that only names a CLI (`python -m engines
inspect`, no flags) must answer `--help`. A `make T VAR=value ...` command is expanded with
`make -n`: T must exist, VAR must be one the Makefile reads, and every `python -m` command it would
run is parsed as above (so `ENGINES_ARGS="--memory"` is checked against the engines CLI).

Run as a script, this file is the parse driver: it reads [module, argv] pairs as JSON on stdin.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGES = {p.parent.name for p in ROOT.glob("*/__init__.py")}  # what `python -m` may name here
ELIDED = "..."


@dataclass(frozen=True)
class Command:
    where: str  # file:line, for the failure message
    tool: str  # "python" or "make"
    argv: tuple[str, ...]  # python: (module, *args); make: (targets and VAR=value)
    names_only: bool = False  # inline code without a flag: it names the CLI rather than runs it

    def __str__(self) -> str:
        shown = ("python -m " if self.tool == "python" else "make ") + shlex.join(self.argv)
        return f"{self.where}: {shown}"


# --- finding the commands -------------------------------------------------------------------------


def _words(text: str) -> list[str]:
    """The shell words of a quoted command, without its comment and the [optional] brackets docs use."""
    try:
        words = shlex.split(text, comments=True)
    except ValueError:  # an unbalanced quote: the command is prose, not shell
        return []
    return [w.strip("[]") for w in words if w not in ("[", "]")]  # `--passes ""` keeps its empty value


def _command(words: list[str], where: str, inline: bool = False) -> Command | None:
    if words[:2] == ["python", "-m"] and len(words) > 2 and words[2].split(".")[0] in PACKAGES:
        return Command(where, "python", tuple(words[2:]), inline and not any(w.startswith("-") for w in words[3:]))
    if words[:1] == ["make"] and len(words) > 1 and words[1] != ELIDED:
        return Command(where, "make", tuple(words[1:]))
    return None


def quoted_commands(text: str, name: str) -> list[Command]:
    """The commands of a markdown text: lines of its code blocks, and its inline code spans."""
    commands, prose, in_block, pending = [], [], False, ""
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_block = not in_block
            continue
        if not in_block:
            prose.append((number, line))
            continue
        line = pending + line.strip().removeprefix("$ ")
        if line.endswith("\\"):  # continued on the next line
            pending = line[:-1] + " "
            continue
        pending = ""
        command = _command(_words(line), f"{name}:{number}")
        commands.append(command)
    # Inline code may wrap across lines of a paragraph: join them before looking for spans.
    joined = " ".join(line for _, line in prose)
    starts = {}  # offset in `joined` -> line number, to say where a span is
    offset = 0
    for number, line in prose:
        starts[offset] = number
        offset += len(line) + 1
    for match in re.finditer(r"`([^`]+)`", joined):
        line = max(n for o, n in starts.items() if o <= match.start())
        commands.append(_command(_words(match.group(1)), f"{name}:{line}", inline=True))
    return [c for c in commands if c is not None]


def documented_commands() -> list[Command]:
    return [c for doc in DOCS for c in quoted_commands(doc.read_text(), str(doc.relative_to(ROOT)))]


# --- checking them --------------------------------------------------------------------------------


def _parse_requests(requests: list[tuple[str, list[str]]]) -> list[dict]:
    """Runs this file as the driver once for every request: one process, each CLI imported once."""
    run = subprocess.run([sys.executable, __file__], input=json.dumps(requests), capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def _python_problems(commands: list[Command]) -> list[str]:
    requests = []
    for c in commands:
        module, *args = c.argv
        # A name, or an elided command: the parser its leading words pick (a subcommand's), asked for
        # its options.
        if c.names_only or ELIDED in args:
            leading = next((i for i, w in enumerate(args) if w.startswith("-") or w == ELIDED), len(args))
            args = args[:leading] + ["--help"]
        requests.append((module, args))
    problems = []
    for c, result in zip(commands, _parse_requests(requests)):
        if result["outcome"] != "ok":
            problems.append(f"{c}\n    {result['outcome']}")
        elif ELIDED in c.argv:
            flags = [w.split("=")[0] for w in c.argv if w.startswith("--")]
            unknown = [f for f in flags if f not in result["options"]]
            if unknown:
                problems.append(f"{c}\n    {', '.join(unknown)} not among the parser's options")
    return problems


def _makefile_reads(variable: str, makefile: str) -> bool:
    return bool(re.search(rf"\$\({re.escape(variable)}\)|^{re.escape(variable)}\s*[?:]?=", makefile, re.M))


def _make_problems(commands: list[Command]) -> list[str]:
    """Each make command expanded with `make -n`; the python commands it prints, for the parse check."""
    makefile = (ROOT / "Makefile").read_text()
    problems, expanded = [], []
    for c in commands:
        unknown = [w.split("=")[0] for w in c.argv if "=" in w and not _makefile_reads(w.split("=")[0], makefile)]
        if unknown:
            problems.append(f"{c}\n    the Makefile reads no variable {', '.join(unknown)}")
        run = subprocess.run(["make", "-n", "--no-print-directory", *c.argv], capture_output=True, text=True,
                             cwd=ROOT, timeout=60)
        if run.returncode != 0:
            problems.append(f"{c}\n    make -n: {(run.stderr.strip().splitlines() or ['exit %d' % run.returncode])[-1]}")
            continue
        for line in run.stdout.replace("\\\n", " ").splitlines():
            words = _words(line)
            if "-m" in words and words.index("-m") + 1 < len(words):
                rest = words[words.index("-m") + 1:]
                if rest[0].split(".")[0] in PACKAGES:
                    expanded.append(Command(f"{c.where} (make {shlex.join(c.argv)})", "python", tuple(rest)))
    return problems + _python_problems(expanded)


def problems_of(commands: list[Command]) -> list[str]:
    return (_python_problems([c for c in commands if c.tool == "python"])
            + _make_problems([c for c in commands if c.tool == "make"]))


# --- the tests ------------------------------------------------------------------------------------


def test_every_quoted_command_parses():
    commands = documented_commands()
    # The docs quote dozens of each: far fewer means the extraction broke, not that the docs shrank.
    assert sum(c.tool == "python" for c in commands) >= 40, commands
    assert sum(c.tool == "make" for c in commands) >= 20, commands
    assert {c.argv[0] for c in commands if c.tool == "python"} >= {"export", "engines", "runners", "bench"}
    problems = problems_of(commands)
    assert not problems, f"{len(problems)} quoted commands no longer parse:\n" + "\n".join(problems)


def test_a_made_up_flag_a_target_and_a_variable_are_caught():
    doc = """
```bash
python -m engines build/sd3-tiny --target ort --no-such-flag   # a flag the CLI does not have
python -m engines build/sd3-tiny --target ort                  # fine
make engines NO_SUCH_VARIABLE=1
make no-such-target
make engines ENGINES_ARGS="--memory --also-no-such-flag"
```
and inline, `python -m runners ... --vae-tiling --made-up-option`, `python -m runners ARTIFACT --prompt ... --steps 2`, `python -m export sd3-tiny --dtype float16`
(no --out) and `python -m engines inspect` (a name).
"""
    commands = quoted_commands(doc, "doc.md")
    assert [str(c) for c in commands] == [
        "doc.md:3: python -m engines build/sd3-tiny --target ort --no-such-flag",
        "doc.md:4: python -m engines build/sd3-tiny --target ort",
        "doc.md:5: make engines NO_SUCH_VARIABLE=1", "doc.md:6: make no-such-target",
        "doc.md:7: make engines 'ENGINES_ARGS=--memory --also-no-such-flag'",
        "doc.md:9: python -m runners ... --vae-tiling --made-up-option",
        "doc.md:9: python -m runners ARTIFACT --prompt ... --steps 2",
        "doc.md:9: python -m export sd3-tiny --dtype float16", "doc.md:10: python -m engines inspect"]
    problems = problems_of(commands)
    assert len(problems) == 6, "\n".join(problems)
    said = "\n".join(problems)
    for expected in ("unrecognized arguments: --no-such-flag", "reads no variable NO_SUCH_VARIABLE",
                     "no-such-target", "unrecognized arguments: --also-no-such-flag",
                     "--made-up-option not among the parser's options", "--out"):
        assert expected in said, said
    assert "--vae-tiling not" not in said


def quoted_paths(doc: Path) -> list[Path]:
    """The repository paths a page quotes as inline code (`engines/passes/registry.py`, from the
    repository's root) and the files its relative links point at (from the page's folder).
    Placeholders (`runners/backends/<name>.py`) are not paths."""
    text = doc.read_text()
    tops = "|".join(sorted(PACKAGES | {"tests", "docs"}))
    quoted = [ROOT / p for p in re.findall(rf"`((?:{tops})/[\w./-]*)`", text)]
    linked = [doc.parent / t for t in re.findall(r"\]\(([^)#\s]+)", text) if "://" not in t]
    return quoted + linked


def test_every_quoted_path_and_link_exists():
    paths = [(doc, path) for doc in DOCS for path in quoted_paths(doc)]
    assert len(paths) >= 100, paths  # far fewer: the extraction broke
    missing = [f"{doc.relative_to(ROOT)}: {path.relative_to(ROOT)}" for doc, path in paths if not path.exists()]
    assert not missing, "quoted paths and links that do not exist:\n" + "\n".join(missing)


# --- the driver (this file as a script) -----------------------------------------------------------


class _Parsed(Exception):
    """Raised right after a CLI's parser accepted its arguments, before the CLI does anything."""


def _main_of(module: str):
    spec = importlib.util.find_spec(module)
    return importlib.import_module(f"{module}.__main__" if spec.submodule_search_locations else module).main


def _drive() -> None:
    original = argparse.ArgumentParser.parse_args
    options = []

    def parse_then_stop(self, args=None, namespace=None):
        options[:] = list(self._option_string_actions)
        original(self, args, namespace)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_then_stop
    results = []
    for module, argv in json.load(sys.stdin):
        err = io.StringIO()
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                _main_of(module)(list(argv))
            outcome = "the CLI returned without calling parse_args: this check cannot stop it"
        except _Parsed:
            outcome = "ok"
        except SystemExit as e:  # argparse's --help exits 0, its errors 2
            lines = err.getvalue().strip().splitlines()
            outcome = "ok" if e.code in (0, None) else (lines[-1] if lines else f"exit {e.code}")
        except Exception as e:  # noqa: BLE001 - an import or a parser that breaks is a finding
            outcome = f"{type(e).__name__}: {e}"
        results.append({"outcome": outcome, "options": list(options)})
        options.clear()
    print(json.dumps(results))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _drive()
