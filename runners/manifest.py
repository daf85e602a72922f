"""The folder contract shared by every stage: manifest.json, its format version, and the
sha256 of every file beside it. Runtime-only dependencies: this module is read by deployed
runners and written by the build side."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

FORMAT_VERSION = 2
MANIFEST = "manifest.json"


class ManifestError(ValueError):
    """The folder is not a usable artifact: what is wrong, and with which file."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def digest(obj) -> str:
    """A short stable hash of JSON-able settings: the cache keys of every stage."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def write_manifest(folder: Path, data: dict, known: dict[str, str] | None = None) -> dict:
    """Write `data` as the folder's manifest, adding the checksums of every other file in it.
    `known` ({file: sha256}) are checksums to take as they are: files hard-linked from another
    artifact, the same bytes, which its manifest hashed (loading the new artifact verifies them)."""
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    known = known or {}
    data = {"format_version": FORMAT_VERSION, **data,
            "files": {rel: known[rel] if rel in known else sha256_file(folder / rel) for rel in files}}
    (folder / MANIFEST).write_text(json.dumps(data, indent=2) + "\n")
    return data


def read_manifest(folder: Path, verify: bool = True) -> dict:
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise ManifestError(f"{folder} is not an artifact folder: {MANIFEST} is missing{_where_they_are(folder)}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path} is not valid JSON: {e}") from None
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise ManifestError(
            f"{path} has format version {version!r}; this runner reads version {FORMAT_VERSION}. "
            f"Rebuild the artifact with this version of diffusion-aot."
        )
    if verify:
        verify_files(folder, data)
    return data


def _where_they_are(folder: Path) -> str:
    """A missing folder said as such, and a build folder's artifacts named (their options name them)."""
    if not folder.exists():
        return " (the folder does not exist)"
    artifacts = sorted(p.parent.name for p in folder.glob(f"*/{MANIFEST}") if _is_artifact(p.parent))
    return f"; the artifacts in it: {', '.join(artifacts)}" if artifacts else ""


def _is_artifact(folder: Path) -> bool:
    """A folder this runner loads (an export's manifest names no target)."""
    try:
        return "target" in read_manifest(folder, verify=False)
    except ManifestError:
        return False


def is_current(folder: Path, cache_key: str) -> bool:
    """True when `folder` is a complete, intact output of the same inputs and settings."""
    if not (Path(folder) / MANIFEST).exists():
        return False
    try:
        return read_manifest(folder).get("cache_key") == cache_key
    except ManifestError:
        return False


def verify_files(folder: Path, data: dict) -> None:
    for rel, digest in data.get("files", {}).items():
        path = folder / rel
        if not path.is_file():
            raise ManifestError(f"{folder}: {rel} is listed in {MANIFEST} but missing")
        if sha256_file(path) != digest:
            raise ManifestError(f"{folder}: {rel} does not match its checksum in {MANIFEST} (corrupted or edited)")


@contextlib.contextmanager
def atomic_folder(dest: Path):
    """Yield a temporary folder beside `dest`; on success it replaces `dest` in one rename.

    On any failure, Ctrl-C included, the temporary folder is removed and `dest` is untouched:
    a stage's output folder is complete or absent.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        yield tmp
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def exclusive(dest: Path):
    """Hold `dest`'s lock while deciding whether to write `dest` and writing it: a second process
    producing the same folder (two builds, or test workers, at once) waits here, then finds it current
    instead of writing it again or replacing it under the first one's readers. The lock file is in the
    system's temporary folder, named by `dest`'s absolute path: nothing is added beside the outputs."""
    from filelock import FileLock  # the build side's: a deployed runner only reads folders

    locks = Path(tempfile.gettempdir()) / "diffusion-aot-locks"
    locks.mkdir(exist_ok=True)
    with FileLock(locks / f"{digest(str(Path(dest).resolve()))}.lock"):
        yield


def write_once(dest: Path, marker: str, write) -> Path:
    """`dest`, written by `write(tmp)` into a temporary folder unless it holds `marker` already: one
    writer at a time, and a complete folder or none."""
    with exclusive(dest):
        if not (Path(dest) / marker).exists():
            with atomic_folder(dest) as tmp:
                write(tmp)
    return Path(dest)


def link_or_copy(src: Path, dest: Path) -> None:
    """`dest` as a hard link to `src` (the same bytes, no space), or a copy across filesystems."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dest)
    except OSError:  # another filesystem, or one without hard links
        shutil.copy2(src, dest)


def load_onnx(path: Path):
    """`onnx_ir.load`, for a graph whose external data file may be one of our hard links (a LoRA
    artifact and a Triton repository share the files they leave unchanged that way). onnx-ir
    refuses to read a file with more than one link, its guard against a link planted in a model
    folder someone else can write to; ours are made by our own stages, so each external tensor is
    pointed at its file by absolute path instead: the same bytes, memory-mapped as before. Save
    the result with its weights written out (`save_graph`, `ir.save(..., external_data=...)`)."""
    import onnx_ir as ir

    model = ir.load(path)
    for value in model.graph.initializers.values():
        t = value.const_value
        if isinstance(t, ir.ExternalTensor):
            value.const_value = ir.ExternalTensor(os.path.abspath(t.path), t.offset, t.length, t.dtype,
                                                  shape=t.shape, name=t.name)
    return model


ONNX_INLINE_LIMIT = 2**31  # protobuf's limit: a larger graph keeps its weights in NAME.onnx.data
SMALL_INLINE_BYTES = 1024


def tensor_values(tensor):
    """An onnx-ir tensor's values as a new numpy array, leaving no mapping of its file resident: an
    ExternalTensor keeps its memory map once read, and a real-size model's weights read so (24 GB of
    FLUX.1's) would all stay mapped."""
    import numpy as np
    import onnx_ir as ir

    array = np.array(tensor.numpy())
    if isinstance(tensor, ir.ExternalTensor):
        tensor.release()
    return array


def save_graph(model, path: Path, external: set[str] = frozenset(), link: bool = False) -> list[str]:
    """Write an onnx-ir model as a stage's graph file: weights inline up to 2 GB, else in one
    external file beside it, streamed there a tensor at a time from wherever they live (a
    checkpoint, a memory map, a tensor computed on demand). The initializers named in `external`
    go to that file whatever the total or their own size. `link`: weights still read unchanged from
    another graph's external data stay there, its file hard-linked beside this one as
    NAME.onnx.linked.data (`_link_external`). Returns the file names written."""
    import onnx_ir as ir

    path = Path(path)
    size = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    if external or (link and size > ONNX_INLINE_LIMIT):
        return _save_with_external(model, path, external, link)
    data = f"{path.name}.data" if size > ONNX_INLINE_LIMIT else None
    if data is None:  # inline: weights that still point at another file (a checkpoint) are read in
        ir.external_data.load_to_model(model)
    # Small constants stay inline even then: ONNX Runtime reads shapes, axes and split sizes
    # (Split's widths after fuse_qkv) at load time, and refuses them as external data.
    ir.save(model, path, external_data=data, size_threshold_bytes=SMALL_INLINE_BYTES)
    return [path.name] + ([data] if data else [])


def _save_with_external(model, path: Path, external: set[str], link: bool = False) -> list[str]:
    """`save_graph` with every weight over SMALL_INLINE_BYTES, and those named in `external`, in
    NAME.onnx.data (or, with `link`, where `_link_external` leaves them); the other small constants inline."""
    import onnx_ir as ir

    data = f"{path.name}.data"
    values = [v for v in model.graph.initializers.values() if v.const_value is not None]
    outside = [v for v in values if v.name in external or v.const_value.nbytes > SMALL_INLINE_BYTES]
    chosen = {id(v) for v in outside}
    inside = [v for v in values if id(v) not in chosen and isinstance(v.const_value, ir.ExternalTensor)]
    for value, tensor in zip(inside, ir.external_data.convert_tensors_from_external([v.const_value for v in inside])):
        value.const_value = tensor
    linked = _link_external(outside, path) if link else []
    outside = [v for v in outside if not (isinstance(v.const_value, ir.ExternalTensor) and
                                          v.const_value.location in linked)]
    for value, tensor in zip(outside, ir.external_data.convert_tensors_to_external(
            [v.const_value for v in outside], path.parent, data)):
        value.const_value = tensor
    ir.save(model, path)
    return [path.name, *([data] if outside else []), *linked]


def _link_external(values: list, path: Path) -> list[str]:
    """Hard-link the external data files of another folder that `values` read (an export's weights, which the
    ONNX Runtime target's passes mostly leave as they are) beside `path`, and point those values at the links;
    returns the links' names. A real-size model's artifact then takes no disk beside its export (Qwen-Image's
    transformer: 41 GB in fp16); what it ships alone also carries the bytes of the weights a pass replaced
    (fuse_qkv's separate Q, K and V)."""
    import onnx_ir as ir

    here = path.parent.resolve()
    files = {}
    for value in values:
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor) and Path(tensor.path).resolve().parent != here:
            files.setdefault(Path(tensor.path).resolve(), []).append(value)
    names = []
    for i, (file, readers) in enumerate(files.items()):
        name = f"{path.name}.linked{i or ''}.data"
        link_or_copy(file, path.parent / name)
        for value in readers:
            t = value.const_value
            value.const_value = ir.ExternalTensor(name, t.offset, t.length, t.dtype, shape=t.shape, name=t.name,
                                                  base_dir=path.parent)
        names.append(name)
    return names
