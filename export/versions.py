"""The installed versions of the packages that shape what the build side writes: part of its cache
keys and manifests."""
from __future__ import annotations

from importlib import metadata

BUILD_PACKAGES = ("torch", "diffusers", "transformers", "onnx", "onnxscript", "onnxruntime", "diffusion-aot")


def package_versions(names=BUILD_PACKAGES) -> dict[str, str]:
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out
