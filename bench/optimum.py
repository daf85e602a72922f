"""Peer (c): Hugging Face Optimum-ONNX's export of the same pipeline folder, run by its own ONNX
Runtime pipeline. Optimum-ONNX pins transformers < 4.58 and so cannot share our environment:
it lives in .venv-optimum (the Makefile's `optimum-venv` target).

Two files of a folder saved by transformers 5 do not load in transformers 4.57, so Optimum
exports a copy where they are rewritten (weights are hard links, not copies):
- model_index.json names the slow tokenizer classes, which need vocab files that transformers 5
  no longer writes: the copy names the fast classes, which read the same tokenizer.json;
- tokenizer_3/tokenizer_config.json lists T5's sentinels under transformers 5's key
  `extra_special_tokens`; the copy uses the older `additional_special_tokens`.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from runners.manifest import atomic_folder

FAST_TOKENIZERS = {"CLIPTokenizer": "CLIPTokenizerFast", "T5Tokenizer": "T5TokenizerFast"}


def _rewrite(path: Path, edit) -> None:
    data = edit(json.loads(path.read_text()))
    path.unlink()  # a hard link to the source: replace the file, never write through it
    path.write_text(json.dumps(data, indent=2))


def _transformers4_copy(src: Path, dest: Path) -> None:
    shutil.copytree(src, dest, copy_function=os.link)
    _rewrite(dest / "model_index.json", lambda index: {
        k: [v[0], FAST_TOKENIZERS.get(v[1], v[1])] if isinstance(v, list) else v for k, v in index.items()})
    t5_config = dest / "tokenizer_3" / "tokenizer_config.json"
    if t5_config.exists():
        def rename(cfg):
            if isinstance(cfg.get("extra_special_tokens"), list):
                cfg["additional_special_tokens"] = cfg.pop("extra_special_tokens")
            return cfg
        _rewrite(t5_config, rename)


def export_once(build: Path, name: str, log, export) -> tuple[Path, float]:
    """A peer's export into build/`name`, made once by `export(folder)` (which runs the peer's CLI
    and returns the exported pipeline folder inside `folder`, and the seconds its export took);
    returns that folder and the seconds, reused on later runs."""
    dest = build / name
    record = dest / "export.json"
    if record.exists():
        log(f"{dest} exists: reusing {name}'s export")
        done = json.loads(record.read_text())
        return dest / done["folder"], done["seconds"]
    with atomic_folder(dest) as tmp:
        folder, seconds = export(tmp)
        (tmp / "export.json").write_text(json.dumps({"folder": folder.name, "seconds": seconds}))
    return dest / folder.name, seconds


def timed_cli(argv: list[str], log) -> float:
    """Run a peer's CLI (its executable named by path); return the seconds it took."""
    log(" ".join([Path(argv[0]).name, *argv[1:]]))
    t0 = time.perf_counter()
    subprocess.run(argv, check=True)
    return time.perf_counter() - t0


def optimum_export(python: str, src: Path, build: Path, log) -> tuple[Path, float]:
    """Export `src` with optimum-cli into build/optimum (once); returns the folder and export seconds."""
    def export(tmp: Path):
        _transformers4_copy(src, tmp / "source")
        cli = str(Path(python).parent / "optimum-cli")
        seconds = timed_cli([cli, "export", "onnx", "--model", str(tmp / "source"), "--task", "text-to-image",
                             str(tmp / "onnx")], log)
        shutil.rmtree(tmp / "source")
        return tmp / "onnx", seconds

    return export_once(build, "optimum", log, export)
