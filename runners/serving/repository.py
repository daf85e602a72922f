"""An artifact -> a Triton Inference Server model repository, in one of two layouts:

- "python" (runs here, and on any Triton with the Python backend): one Python-backend model
  whose version folder holds the artifact, this runners package, and a model.py that opens the
  artifact as a Pipeline (runners/serving/triton_model.py). Dynamic batching on.
- "native" (for servers with Triton's onnxruntime / tensorrt / openvino backends): each engine
  becomes a model of its backend, and the pipeline model keeps the tokenizers, the scheduler and
  the loop, calling the engines through BLS (runners/backends/triton_bls.py).

The repository is written whole or not at all (runners.manifest.atomic_folder). Files are hard
links to the artifact's where the filesystem allows, copies otherwise."""
from __future__ import annotations

import shutil
from pathlib import Path

from runners.backends import backend_of, get_backend
from runners.manifest import atomic_folder, link_or_copy, read_manifest, write_manifest
from runners.serving.requests import Tensor, inputs_for, outputs_for

LAYOUTS = ("python", "native")
ARTIFACT_DIR = "artifact"  # inside the version folder
RUNNERS = Path(__file__).resolve().parents[1]
DTYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "int64": "TYPE_INT64",
          "int32": "TYPE_INT32", "int8": "TYPE_INT8", "uint8": "TYPE_UINT8", "bool": "TYPE_BOOL"}

MODEL_PY = '''"""Triton's Python backend loads this file. The model is runners.serving.triton_model's, from the
runners package beside this file (only numpy, tokenizers, Pillow and the artifact's backend needed)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runners.serving.triton_model import TritonPythonModel  # noqa: E402,F401
'''


def _tensor(t: Tensor) -> str:
    optional = " optional: true" if t.optional else ""
    return f'  {{ name: "{t.name}" data_type: {t.data_type} dims: [ {", ".join(map(str, t.dims))} ]{optional} }}'


def _parameters(params: dict[str, str]) -> str:
    items = ",\n".join(f'  {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in params.items())
    return f"parameters [\n{items}\n]\n"


def _io(inputs, outputs) -> str:
    return "".join(f"{kind} [\n" + ",\n".join(map(_tensor, tensors)) + "\n]\n"
                   for kind, tensors in (("input", inputs), ("output", outputs)))


def runs_on_gpu(manifest: dict) -> bool:
    """Whether one of the artifact's engines runs on a GPU (its backend says)."""
    return any(get_backend(backend_of(manifest, name)).gpu for name in manifest["submodules"])


def _kind(gpu: bool) -> str:
    return "KIND_GPU" if gpu else "KIND_CPU"


def pipeline_config(name: str, manifest: dict, max_batch_size: int, instances: int, queue_delay_us: int,
                    params: dict[str, str]) -> str:
    """The pipeline model's config.pbtxt: the request's fields as inputs, the images (a video's frames and mp4 files)
    as outputs."""
    kind = _kind(runs_on_gpu(manifest))
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: {max_batch_size}\n'
            + _io(inputs_for(manifest), outputs_for(manifest))
            + f"dynamic_batching {{ max_queue_delay_microseconds: {queue_delay_us} }}\n"
            + f"instance_group [ {{ kind: {kind} count: {instances} }} ]\n"
            + _parameters(params))


def engine_config(name: str, backend: str, entry: dict) -> str:
    """An engine as a model of Triton's own backend for the runner's `backend`: no batching of its own
    (the pipeline batches), a dimension the engine was built with a range for is -1."""
    runtime = get_backend(backend)
    if runtime.triton is None:
        raise ValueError(f"{name}: Triton has no backend of its own for {runtime.title} engines: "
                         "use the python layout (--layout python)")
    def tensors(items):
        dims = entry.get("dims", {})
        return [Tensor(t["name"], DTYPES[t["dtype"]], tuple(
            d if isinstance(d, int) else (dims[d][0] if d in dims and dims[d][0] == dims[d][2] else -1)
            for d in t["shape"]), optional=False) for t in items]

    return (f'name: "{name}"\n{runtime.triton}\nmax_batch_size: 0\n'
            f'default_model_filename: "{entry["file"]}"\n' + _io(tensors(entry["inputs"]), tensors(entry["outputs"]))
            + f"instance_group [ {{ kind: {_kind(runtime.gpu)} count: 1 }} ]\n")


def _engine_files(manifest: dict, entry: dict) -> list[str]:
    """The engine's files: all that share its name's stem (ONNX's `.onnx.data` weights, OpenVINO's
    `.bin` beside its `.xml`, the compiled blobs)."""
    stem = entry["file"].split(".")[0]
    return [f for f in manifest["files"] if f.startswith(stem + ".")]


def _runners_copy(dest: Path) -> None:
    shutil.copytree(RUNNERS, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def write_repository(artifact, out, *, layout: str = "python", model_name: str | None = None,
                     max_batch_size: int | None = None, instances: int = 1, queue_delay_us: int = 2000,
                     batch_requests: bool = False, reference_artifact: bool = False,
                     threads: int | None = None, lora_dir: str | None = None, max_loras: int = 4,
                     lora_cache_mib: int = 2048) -> Path:
    """Write the repository `out` for `artifact`; returns the pipeline model's folder.
    `max_batch_size`: prompts per Triton batch (default: what one denoiser call of the artifact takes
    with guidance); `instances`: Pipeline copies per device; `batch_requests`: run queued requests
    with equal settings as one Pipeline call; `reference_artifact`: the config names the artifact's
    absolute path instead of holding a copy (python layout); `lora_dir`: the folder whose adapters a
    request may name (at most `max_loras` at once; the adapted weights of recent sets kept within
    `lora_cache_mib`, runners/serving/adapters.py), referenced by its absolute path."""
    artifact = Path(artifact).resolve()
    manifest = read_manifest(artifact)
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not allowed: use one of {', '.join(LAYOUTS)}")
    if reference_artifact and layout != "python":
        raise ValueError("--reference-artifact is the python layout's: the native layout splits the artifact into "
                         "one model per engine")
    for name, value, least in (("max_batch_size", max_batch_size, 1), ("instances", instances, 1),
                               ("queue_delay_us", queue_delay_us, 0), ("max_loras", max_loras, 1),
                               ("lora_cache_mib", lora_cache_mib, 0)):
        if value is not None and (not isinstance(value, int) or value < least):
            raise ValueError(f"{name}={value!r} is not allowed: use an integer >= {least}")
    name = model_name or manifest["model"]["name"]
    capacity = max(1, manifest["dims"]["batch"][2] // 2)
    params = {"artifact": str(artifact) if reference_artifact else ARTIFACT_DIR,
              "batch_requests": "true" if batch_requests else "false"}
    if threads:
        params["threads"] = str(threads)
    if lora_dir:
        if not Path(lora_dir).is_dir():
            raise ValueError(f"--lora-dir {lora_dir}: not a folder (the adapters' .safetensors files go there)")
        if layout != "python":
            raise ValueError("--lora-dir is the python layout's: the native layout's engines are Triton's own models")
        params.update(lora_dir=str(Path(lora_dir).resolve()), max_loras=str(max_loras),
                      lora_cache_mib=str(lora_cache_mib))
    with atomic_folder(Path(out)) as repo:
        model = repo / name
        version = model / "1"
        version.mkdir(parents=True)
        (model / "config.pbtxt").write_text(pipeline_config(
            name, manifest, max_batch_size or capacity, instances, queue_delay_us, params))
        (version / "model.py").write_text(MODEL_PY)
        _runners_copy(version / "runners")
        if layout == "python" and not reference_artifact:
            for file in [*manifest["files"], "manifest.json"]:
                link_or_copy(artifact / file, version / ARTIFACT_DIR / file)
        elif layout == "native":
            _write_native(artifact, manifest, repo, name, version / ARTIFACT_DIR)
    return Path(out) / name


def _write_native(artifact: Path, manifest: dict, repo: Path, name: str, pipeline_artifact: Path) -> None:
    """One model per engine, and the pipeline's artifact without engines: its manifest sends each
    submodule to the engine's model through BLS (target "triton")."""
    engine_files = set()
    submodules = {}
    for sub, entry in manifest["submodules"].items():
        engine = f"{name}_{sub}"
        (repo / engine / "1").mkdir(parents=True)
        (repo / engine / "config.pbtxt").write_text(engine_config(engine, backend_of(manifest, sub), entry))
        for file in _engine_files(manifest, entry):
            link_or_copy(artifact / file, repo / engine / "1" / file)
            engine_files.add(file)
        submodules[sub] = {**entry, "target": "triton", "backend": "triton", "file": engine,
                           "session_options": {"model": engine, "outputs": [o["name"] for o in entry["outputs"]]}}
    for file in set(manifest["files"]) - engine_files:
        link_or_copy(artifact / file, pipeline_artifact / file)
    rest = {k: v for k, v in manifest.items() if k not in ("files", "format_version")}
    write_manifest(pipeline_artifact, {**rest, "submodules": submodules})


def describe(repo: Path) -> str:
    """One line a model: its name and what serves it (for the command's summary)."""
    lines = []
    for config in sorted(Path(repo).glob("*/config.pbtxt")):
        kind = next(line for line in config.read_text().splitlines() if line.startswith(("backend", "platform")))
        lines.append(f"  {config.parent.name}: {kind.split(':', 1)[1].strip()}")
    return "\n".join(lines)

