"""A KServe InferenceService (serving.kserve.io/v1beta1) for a Triton model repository: KServe's
Triton runtime serves the repository from `storageUri`, and its autoscaler adds replicas. JSON is
YAML too: `kubectl apply -f inferenceservice.json` takes it as it is."""
from __future__ import annotations

import json
import re
from pathlib import Path

from runners.manifest import read_manifest
from runners.serving.repository import runs_on_gpu

FILE = "inferenceservice.json"


def inference_service(name: str, storage_uri: str, gpu: bool, artifact_bytes: int) -> dict:
    """The manifest; resources are a starting point to edit: 2 CPUs, and memory for the artifact's files
    twice over plus 2 GiB (weights in the engines' sessions, and the process itself)."""
    service = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:63] or "diffusion"
    limits = {"cpu": "2", "memory": f"{int(2 * artifact_bytes / 2**30) + 2}Gi"}
    if gpu:
        limits["nvidia.com/gpu"] = "1"
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {"name": service},
        "spec": {"predictor": {
            "minReplicas": 1,
            "maxReplicas": 1,  # raise it, and KServe's autoscaler adds replicas with the load
            "model": {
                "modelFormat": {"name": "triton"},
                "protocolVersion": "v2",
                "runtime": "kserve-tritonserver",
                "storageUri": storage_uri,
                "resources": {"limits": limits, "requests": dict(limits)},
            },
        }},
    }


def write_inference_service(repo, model_name: str, storage_uri: str, artifact) -> Path:
    manifest = read_manifest(Path(artifact), verify=False)
    size = sum((Path(artifact) / f).stat().st_size for f in manifest["files"])
    path = Path(repo) / FILE
    service = inference_service(model_name, storage_uri, runs_on_gpu(manifest), size)
    path.write_text(json.dumps(service, indent=2) + "\n")
    return path
