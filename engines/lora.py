"""`apply_loras`: a built artifact with LoRA adapters merged into its weights, without re-export.

Only what the adapters change is written: the adapted weights go to a data file of their own,
`<engine>.lora-<hash>.data`, and the graph of each engine they touch (its structure, a small file)
is rewritten to read them from there (`runners/adapters/provenance.py` records the new places). Every other
file, the large weight files included, is a hard link to the source artifact's (a copy where the
filesystem has no links). The manifest records each adapter's file, sha256 and scale.

An artifact whose backend takes adapters as low-rank branches (OpenVINO, runners/adapters/branches.py)
keeps its engines as built: the adapter files are copied into it (`loras/<sha256>.safetensors`) and
its manifest's `lora_branches` names them, which the runner applies at load as it applies adapters at
run time (the same branches, the same images; an int8 base stays int8).

`python -m engines lora ARTIFACT --lora PATH[:SCALE] ... --out NEW` is the command line of it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from runners.backends import get_backend
from runners.adapters.lora import LoraError, adapted_submodules, parse_lora_spec, submodule_tables
from runners.adapters.branches import branch_factors
from runners.manifest import (
    ManifestError, atomic_folder, digest, link_or_copy, read_manifest, sha256_file, write_manifest,
)
from runners.adapters.quantized import FLOAT8_E4M3FN


def _log(msg: str) -> None:
    print(f"[lora] {msg}", flush=True)


def apply_loras(artifact: Path, loras: dict, out: Path, ignore_unmatched: bool = False) -> Path:
    """Write `artifact` with `loras` ({path: scale}) applied to `out`; returns `out`."""
    artifact, out = Path(artifact), Path(out)
    if not loras:
        raise LoraError("give at least one adapter (--lora PATH[:SCALE])")
    if out.resolve() == artifact.resolve():
        raise LoraError(f"--out {out} is the source artifact: write the adapted artifact to a new folder")
    # Not verified here: every file of the new artifact is the source's (hard links, with the source's
    # checksums) or written now, and loading the new artifact verifies them all.
    manifest = read_manifest(artifact, verify=False)
    if manifest.get("stage") != "artifact":
        raise ManifestError(f"{artifact} is not a built artifact (its stage is {manifest.get('stage')!r})")
    missing = [str(p) for p in loras if not Path(p).is_file()]  # before its checksum is read
    if missing:
        raise LoraError(f"adapter {missing[0]} does not exist")
    record = [{"file": Path(p).name, "sha256": sha256_file(p), "scale": float(s)} for p, s in loras.items()]
    backend = get_backend(manifest["backend"])
    if backend.lora_branches:
        return _with_branches(artifact, manifest, loras, record, out, ignore_unmatched)
    if backend.gpu:
        raise LoraError(f"{artifact} holds {backend.title} engines, whose weights are inside them: apply adapters at "
                        "load (loras=, set_loras, --lora) to an artifact built with --refittable")
    changed = adapted_submodules(artifact, manifest, loras, ignore_unmatched)
    tables = submodule_tables(artifact, manifest)
    with atomic_folder(out) as tmp:
        written = set()
        for name, weights in changed.items():
            sub = manifest["submodules"][name]
            data_file = f"{name}.lora-{digest(record)[:8]}.data"
            _rewrite_graph(artifact / sub["file"], tmp / sub["file"], weights, data_file, tables[name])
            tables[name].save(tmp / sub["weights_file"])
            written |= {sub["file"], sub["weights_file"], data_file}
            _log(f"{name}: {len(weights)} weights adapted, in {data_file}")
        for rel in manifest["files"]:
            if rel not in written:
                link_or_copy(artifact / rel, tmp / rel)
        data = {k: v for k, v in manifest.items() if k not in ("files", "format_version")}
        write_manifest(tmp, {**data, "loras": manifest.get("loras", []) + record, "lora_source": str(artifact)},
                       known={rel: sha for rel, sha in manifest["files"].items() if rel not in written})
    _log(f"wrote {out} ({len(written)} files written, {len(manifest['files']) + len(changed) - len(written)} "
         f"shared with {artifact})")
    return out


def _with_branches(artifact: Path, manifest: dict, loras: dict, record: list, out: Path,
                   ignore_unmatched: bool) -> Path:
    """`artifact` (every file linked) with the adapter files copied in and named by `lora_branches`."""
    baked = {artifact / e["file"]: e["scale"] for e in manifest.get("lora_branches", [])}
    reached = branch_factors(artifact, manifest, {**baked, **loras}, ignore_unmatched)  # refused here, not at load
    branches = [{"file": f"loras/{r['sha256'][:16]}.safetensors", "scale": r["scale"]} for r in record]
    with atomic_folder(out) as tmp:
        for rel in manifest["files"]:
            link_or_copy(artifact / rel, tmp / rel)
        for path, entry in zip(loras, branches):
            link_or_copy(Path(path), tmp / entry["file"])
        data = {k: v for k, v in manifest.items() if k not in ("files", "format_version")}
        write_manifest(tmp, {**data, "loras": manifest.get("loras", []) + record, "lora_source": str(artifact),
                             "lora_branches": manifest.get("lora_branches", []) + branches}, known=manifest["files"])
    _log(f"wrote {out}: {len(record)} adapters as branches of {', '.join(sorted(reached))} (every engine shared "
         f"with {artifact})")
    return out


def _rewrite_graph(source: Path, dest: Path, weights: dict, data_file: str, table) -> None:
    """`source`'s graph with `weights` in a new external data file of their own beside `dest`;
    every other weight stays where it is (in the data files `dest` shares with `source`), and
    `table` records the new places."""
    import onnx_ir as ir

    model = ir.load(source)
    values = [model.graph.initializers[name] for name in weights]
    tensors = ir.external_data.convert_tensors_to_external(
        [_tensor(weights[v.name], v.name) for v in values], dest.parent, data_file)
    for value, tensor in zip(values, tensors):
        value.const_value = tensor
        table[value.name]["location"] = {"file": data_file, "offset": tensor.offset, "length": tensor.length}
    ir.save(model, dest)


def _tensor(array: np.ndarray, name: str):
    """An onnx-ir tensor of `array`; fp8 bytes (runners.adapters.quantized.FLOAT8_E4M3FN) as FLOAT8E4M3FN."""
    import onnx_ir as ir

    if array.dtype == FLOAT8_E4M3FN:
        return ir.tensor(array.view(np.uint8), dtype=ir.DataType.FLOAT8E4M3FN, name=name)
    return ir.tensor(array, name=name)


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
