"""`apply_loras`: a built artifact with LoRA adapters merged into its weights, without re-export.

Only what the adapters change is rewritten: the external-data file of each engine they touch is
copied with the adapted weights written at their recorded places (`runners/provenance.py`); every
other file, the graphs included, is a hard link to the source artifact's (a copy where the
filesystem has no links). The manifest records each adapter's file, sha256 and scale.

`python -m engines lora ARTIFACT --lora PATH[:SCALE] ... --out NEW` is the command line of it.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from runners.lora import LoraError, adapted_submodules, parse_lora_spec, sha256, submodule_tables
from runners.manifest import ManifestError, atomic_folder, read_manifest, write_manifest


def _log(msg: str) -> None:
    print(f"[lora] {msg}", flush=True)


def _link_or_copy(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dest)
    except OSError:  # another filesystem, or one without hard links
        shutil.copy2(src, dest)


def apply_loras(artifact: Path, loras: dict, out: Path, ignore_unmatched: bool = False) -> Path:
    """Write `artifact` with `loras` ({path: scale}) applied to `out`; returns `out`."""
    artifact, out = Path(artifact), Path(out)
    if not loras:
        raise LoraError("give at least one adapter (--lora PATH[:SCALE])")
    if out.resolve() == artifact.resolve():
        raise LoraError(f"--out {out} is the source artifact: write the adapted artifact to a new folder")
    manifest = read_manifest(artifact)
    if manifest.get("stage") != "artifact":
        raise ManifestError(f"{artifact} is not a built artifact (its stage is {manifest.get('stage')!r})")
    changed = adapted_submodules(artifact, manifest, loras, ignore_unmatched)
    tables = submodule_tables(artifact, manifest)
    with atomic_folder(out) as tmp:
        rewritten = set()
        for name, weights in changed.items():
            table = tables[name]
            by_file: dict[str, list] = {}
            for weight, value in weights.items():
                by_file.setdefault(table[weight]["location"]["file"], []).append((table[weight]["location"], value))
            for file, places in by_file.items():
                shutil.copy2(artifact / file, tmp / file)
                with open(tmp / file, "r+b") as f:
                    for location, value in places:
                        data = value.tobytes()
                        if len(data) != location["length"]:
                            raise LoraError(f"{file}: a weight's adapted bytes ({len(data)}) differ in size from "
                                            f"the stored ones ({location['length']})")
                        f.seek(location["offset"])
                        f.write(data)
                rewritten.add(file)
            _log(f"{name}: {len(weights)} weights adapted")
        for rel in manifest["files"]:
            if rel not in rewritten:
                _link_or_copy(artifact / rel, tmp / rel)
        record = [{"file": Path(p).name, "sha256": sha256(p), "scale": float(s)} for p, s in loras.items()]
        data = {k: v for k, v in manifest.items() if k not in ("files", "format_version")}
        write_manifest(tmp, {**data, "loras": manifest.get("loras", []) + record, "lora_source": str(artifact)})
    _log(f"wrote {out} ({len(rewritten)} files rewritten, {len(manifest['files']) - len(rewritten)} shared)")
    return out


def main(argv=None) -> int:
    from runners.cli import run_cli

    p = argparse.ArgumentParser(prog="python -m engines lora",
                                description="Apply LoRA adapters to a built artifact, writing a new one.")
    p.add_argument("artifact", type=Path, help="a built artifact folder (e.g. build/ort-fp32)")
    p.add_argument("--lora", action="append", required=True, metavar="PATH[:SCALE]",
                   help="an adapter .safetensors (diffusers/PEFT or kohya format) and its scale (default 1); "
                        "repeatable")
    p.add_argument("--out", type=Path, required=True, help="the new artifact's folder")
    p.add_argument("--ignore-unmatched", action="store_true",
                   help="skip adapter keys that match no weight of the artifact (default: an error listing them)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    loras = dict(parse_lora_spec(spec) for spec in args.lora)
    return run_cli(lambda: apply_loras(args.artifact, loras, args.out, args.ignore_unmatched),
                   (LoraError, ManifestError, ValueError), "no artifact was written")
