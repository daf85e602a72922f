"""The import graph of our packages has no cycle, and every third-party package the code imports
is declared in pyproject.toml."""
from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("export", "engines", "runners", "bench")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module this file imports, at any depth (a function-level import is a cycle too once
    it runs)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    # `from runners.x import y` depends on runners.x; `from runners import y` on runners/__init__.
    return {name: {m for m in _imports(path) if m in files and m != name} for name, path in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n):
        state[n] = 1
        path.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        state[n] = 2
        path.pop()
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


# Import names that differ from their distribution's name, and what a runtime provides.
DISTRIBUTION = {"PIL": "pillow", "onnx_ir": "onnx-ir", "onnx_graphsurgeon": "onnx-graphsurgeon",
                "huggingface_hub": "huggingface-hub", "tensorrt_rtx": "tensorrt-rtx", "cuda": "cuda-python",
                "optimum": None,  # optimum: imported only in the peer's own venv (bench/optimum.py)
                "triton_python_backend_utils": None,  # Triton's Python backend provides it to its models
                "google": "protobuf", "cv2": "opencv-python-headless",
                # openvino.genai: imported only in the optimum-intel venv (bench/flux_variants.py)
                "openvino_genai": None,
                "ftfy": None}  # ftfy: used where it is installed, as diffusers' WanPipeline uses it (runners/families/wan)


def test_every_import_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=~!\[; ]", r, maxsplit=1)[0].lower()
                for r in project["dependencies"] + sum(project["optional-dependencies"].values(), [])}
    ours = set(PACKAGES) | {"tests"} | {p.stem for p in (ROOT / "tests").glob("*.py")}  # tests import each other
    missing = set()
    for p in [*(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")), *(ROOT / "tests").glob("*.py")]:
        for m in _imports(p):
            top = m.split(".")[0]
            if top in ours or top in sys.stdlib_module_names:
                continue
            dist = DISTRIBUTION.get(top, top.replace("_", "-"))
            if dist is not None and dist.lower() not in declared:
                missing.add(f"{top} ({p.relative_to(ROOT)})")
    assert not missing, f"imported but not declared in pyproject.toml: {sorted(missing)}"


def test_installed_versions_are_the_locked_ones():
    """The suite runs on the versions in constraints.txt (`make venv` installs through it), so what
    passes here is what a fresh machine gets."""
    from importlib import metadata

    locked = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                  if line and not line.startswith("#"))
    assert {"torch", "onnxruntime", "diffusers", "transformers", "onnx-ir", "openvino"} <= {
        n.lower().replace("_", "-") for n in locked}
    differ = {}
    for name, version in locked.items():
        try:
            installed = metadata.version(name).split("+")[0]  # torch's +cpu build
        except metadata.PackageNotFoundError:
            continue  # e.g. onnxruntime on a GPU machine, which installs onnxruntime-gpu
        if installed != version:
            differ[name] = f"{installed} installed, {version} locked"
    assert not differ, f"run `make venv` (or `make lock` to move the lock): {differ}"
