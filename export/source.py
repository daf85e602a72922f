"""Where a model's weights come from: a registry name, a hub id, or a local pipeline folder.

Whatever the source, the result is a local diffusers folder that is loaded one component
at a time through the components' own `from_pretrained`, as a user's folder would be.
"""
from __future__ import annotations

import copy
import functools
import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from export.families import FAMILIES
from export.registry import MODELS, ModelEntry
from export.random_weights import RECIPE
from export.versions import package_versions
from runners.manifest import digest, sha256_file, write_once


class SourceError(RuntimeError):
    """The model named cannot be found or is not a pipeline this project knows."""


@dataclass(frozen=True)
class ModelSource:
    entry: ModelEntry
    folder: Path
    fingerprint: str  # changes when the weights or configs change: part of the cache key

    @property
    def family(self):
        return FAMILIES[self.entry.family]

    def model_index(self) -> dict:
        return json.loads((self.folder / "model_index.json").read_text())

    def has(self, component: str) -> bool:
        value = self.model_index().get(component)
        return isinstance(value, list) and value[0] is not None

    def config(self, component: str) -> dict:
        folder = self.folder / component
        name = "config.json" if (folder / "config.json").exists() else "scheduler_config.json"
        return json.loads((folder / name).read_text())

    def tokenizer_max_length(self, component: str) -> int:
        return json.loads((self.folder / component / "tokenizer_config.json").read_text())["model_max_length"]

    def component_digest(self, component: str) -> str:
        """What one component is, by content: its files' bytes and the class model_index.json loads it with.
        Models that share a component (FLUX.1 dev, Fill and Kontext share their text encoders and VAE) give
        the same digest wherever their folders are, so an export can take the graph another one made."""
        folder = self.folder / component
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        return digest([self.model_index().get(component),
                       [(p.relative_to(folder).as_posix(), _file_id(p)) for p in files]])

    def load(self, component: str, **kwargs):
        """Load one component with its own class's from_pretrained (memory: one submodule at a time)."""
        if (self.folder / component / RECIPE).exists():
            raise SourceError(f"{self.entry.name}'s {component} has no weights on disk: the export draws them as it "
                              f"writes them (export/random_weights.py), and nothing can load it with from_pretrained")
        library, class_name = self.model_index()[component]
        cls = getattr(importlib.import_module(library), class_name)
        return cls.from_pretrained(self.folder / component, **kwargs)


def cache_root() -> Path:
    return Path(os.environ.get("DIFFUSION_AOT_CACHE", Path.home() / ".cache" / "diffusion-aot"))


def _folder_fingerprint(folder: Path) -> str:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return digest([(str(p.relative_to(folder)), p.stat().st_size, int(p.stat().st_mtime)) for p in files])


# What diffusers and transformers write into a config.json about where and with which release a module
# was saved, not what it is: a component saved again elsewhere (save_pretrained) keeps its digest.
_PROVENANCE_KEYS = ("_name_or_path", "_diffusers_version", "transformers_version", "_commit_hash")


def _file_id(path: Path) -> str:
    if path.name == "config.json":
        config = json.loads(path.read_text())
        return digest({k: v for k, v in config.items() if k not in _PROVENANCE_KEYS})
    return _content_id(path)


def _content_id(path: Path) -> str:
    """A file's content hash: a Hugging Face cache names its blobs by theirs (sha256 for the weights), else
    the file is read, once per process for the same file, size and time."""
    target = path.resolve()
    if path.is_symlink() and target.parent.name == "blobs":
        return target.name
    stat = target.stat()
    return _sha256(target, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=None)
def _sha256(path: Path, size: int, mtime_ns: int) -> str:
    return sha256_file(path)


# What writes a random-weight model folder: the family builders, the weight streamer and the
# offline tokenizers. A change to any of them, or to the libraries that construct and save the
# modules (torch draws their initial weights), builds the folder anew.
_RANDOM_MODEL_CODE = ("families", "random_weights.py", "offline_tokenizers.py")
# families/ files whose random folders (ControlNets, tiny autoencoders) have keys of their own
_OWN_KEYS = ("controlnet", "tiny_vae")
_RANDOM_MODEL_PACKAGES = ("torch", "diffusers", "transformers", "tokenizers", "sentencepiece", "safetensors")


def _random_key(entry: ModelEntry) -> str:
    """Everything that shapes a random-weight folder: its configs, the code that writes it and the
    versions of the libraries that code drives."""
    here = Path(__file__).parent
    files = sorted(p for name in _RANDOM_MODEL_CODE for p in ([here / name] if name.endswith(".py")
                                                             else (here / name).glob("*.py"))
                   if not p.name.startswith(_OWN_KEYS))
    return digest([entry.random_configs, [(p.name, p.read_text()) for p in files],
                   package_versions(_RANDOM_MODEL_PACKAGES)])


def _build_random(entry: ModelEntry) -> Path:
    """Build (once) the random-weight pipeline folder of a registry entry, atomically."""
    key = _random_key(entry)
    folder = cache_root() / "models" / f"{entry.name}-{key}"

    def build(tmp: Path) -> None:
        print(f"[export] building {entry.name} with random seeded weights -> {folder}", flush=True)
        # A copy: transformers' config classes fill in a nested dict they are given (Qwen2.5-VL's rope_scaling
        # gained rope_theta), which changed the entry's key in this process and built the model a second time.
        FAMILIES[entry.family].build_random(copy.deepcopy(entry.random_configs), tmp)

    return write_once(folder, "model_index.json", build)


def _hub_snapshot(entry: ModelEntry) -> Path:
    """The hub model's snapshot: from the Hugging Face cache, else downloaded where the network
    allows. Only "not in the cache and the hub cannot be reached" says so; a gated or unknown
    repository, an HTTP error or a full disk is reported as what it is."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    where = f"'{entry.name}' ({entry.hub_id})"
    try:
        return Path(snapshot_download(entry.hub_id, local_files_only=True))
    except LocalEntryNotFoundError:
        pass  # not in the cache: download it, where the network allows
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("0", "", "false"):
        try:
            return Path(snapshot_download(entry.hub_id))
        except LocalEntryNotFoundError:
            pass  # the hub could not be reached: said below
        except GatedRepoError:
            raise SourceError(f"{where} is gated: accept its license on the hub and log in (`hf auth login`), or "
                              f"pass a local folder") from None
        except RepositoryNotFoundError:
            raise SourceError(f"{where} was not found on the hub, or it is private and your token cannot read it: "
                              f"check the id and log in (`hf auth login`)") from None
        except HfHubHTTPError as e:
            raise SourceError(f"downloading {where} failed: {e}") from None
        except OSError as e:  # a full disk, a cache folder that cannot be written
            raise SourceError(f"downloading {where} failed writing to disk: {e}") from None
    raise SourceError(
        f"the weights of {where} are not in the Hugging Face cache and cannot be "
        f"downloaded here. Download them where the network allows, or pass a local folder: "
        f"make engines MODEL=/path/to/{entry.hub_id.split('/')[-1]}"
    )


def local_or_hub(given: str, option: str, names) -> Path:
    """What an option that takes one model component holds (`--tiny-vae`, `--controlnet`), when it is not
    one of its random test `names`: a local folder, or a hub id (from the cache, or downloaded)."""
    path = Path(given).expanduser()
    if path.exists():
        return path.resolve()
    if given.count("/") != 1:
        raise SourceError(f"{option} {given}: not a folder, a hub id (owner/name) or one of {', '.join(names)}")
    return _hub_snapshot(ModelEntry(name=given, family=option.lstrip("-"), hub_id=given))


def _detect_family(folder: Path) -> str:
    index = folder / "model_index.json"
    if not index.is_file():
        raise SourceError(f"{folder} is not a diffusers pipeline folder (no model_index.json)")
    class_name = json.loads(index.read_text()).get("_class_name")
    for name, family in FAMILIES.items():
        if class_name in family.pipeline_classes:
            return name
    known = ", ".join(c for f in FAMILIES.values() for c in f.pipeline_classes)
    raise SourceError(f"{folder} holds a {class_name}; supported pipelines: {known}")


def resolve(model: str) -> ModelSource:
    """A registry name, or a path to a local diffusers folder."""
    if model in MODELS:
        entry = MODELS[model]
        if entry.random_configs is not None:
            folder = _build_random(entry)
            return ModelSource(entry, folder, _random_key(entry))
        folder = _hub_snapshot(entry)
        _detect_family(folder)
        return ModelSource(entry, folder, _folder_fingerprint(folder))
    path = Path(model).expanduser()
    if path.exists():
        family = _detect_family(path)
        entry = ModelEntry(name=path.resolve().name, family=family, description=f"local folder {path}")
        return ModelSource(entry, path.resolve(), _folder_fingerprint(path))
    raise SourceError(f"unknown model '{model}': not a folder, and not one of: {', '.join(MODELS)}")


if __name__ == "__main__":  # python -m export.source MODEL: build (once) and print a model's folder
    import sys

    if len(sys.argv) != 2:
        sys.exit(f"usage: python -m export.source MODEL (one of: {', '.join(MODELS)}, or a folder)")
    print(resolve(sys.argv[1]).folder)
