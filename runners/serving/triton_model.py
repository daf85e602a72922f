"""The Python-backend model of a Triton repository (`python -m runners triton`): it opens the
artifact as a `Pipeline` once per instance, and answers each request with its images (a video model's frames,
and its mp4 files when the request asks for that output). Only
Triton's Python backend stub imports this (its `triton_python_backend_utils` exists nowhere else);
what a request means is `runners.serving.requests`'s, which the tests drive without Triton.

With dynamic batching, Triton hands `execute` every request queued together; requests that share
their settings then run as one Pipeline call when the repository was written with batching on
(`parameters: batch_requests`); requests that name different adapter sets never run together, and
the model switches sets between runs (runners/serving/adapters.py). A bad request is answered with
INVALID_ARG naming its field, an unexpected failure with INTERNAL: either way that request alone
fails, and the server goes on."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from runners import Pipeline
from runners.manifest import ManifestError, read_manifest
from runners.serving import requests as rq
from runners.serving.adapters import AdapterSets
from runners.video import mp4_bytes


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        version = Path(args["model_repository"]) / args["model_version"]
        artifact = version / params["artifact"]  # an absolute path stays itself
        threads = int(params.get("threads", "0")) or None
        device_map = None
        if args["model_instance_kind"] == "GPU":  # an instance per GPU (instance_group KIND_GPU): its engines there
            manifest = read_manifest(artifact, verify=False)
            device_map = {sub: int(args["model_instance_device_id"]) for sub in manifest["submodules"]}
        self.pipe = Pipeline.load(artifact, threads=threads, device_map=device_map)
        self.adapters = AdapterSets(params.get("lora_dir"), int(params.get("max_loras", "4")),
                                    int(params.get("lora_cache_mib", "2048")) * 2**20, log=lambda m: print(m, flush=True))
        self.batched = params.get("batch_requests", "false") == "true" and not self.pipe.layout.video
        self.names = [t.name for t in rq.inputs_for(self.pipe.manifest)]
        guidance_batch = self.pipe.dims["batch"][2]
        self.max_images = max(1, guidance_batch // 2)  # guidance doubles the denoiser's batch

    def execute(self, requests):
        answers: list = [None] * len(requests)
        rows: list[tuple[int, int, dict]] = []  # (request, its row, the row's Pipeline call)
        for r, request in enumerate(requests):
            try:
                tensors = {}
                for name in self.names:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    if tensor is not None:
                        tensors[name] = tensor.as_numpy()
                rows += [(r, i, call) for i, call in enumerate(rq.calls(tensors))]
            except ValueError as e:
                answers[r] = _error(e, pb_utils.TritonError.INVALID_ARG)
        images: dict[int, dict[int, np.ndarray]] = {}  # request -> row -> its images

        def attempt(run: list[int]) -> None:
            owners = {rows[k][0] for k in run}
            if any(answers[r] is not None for r in owners):
                return  # a row of the same request already failed
            try:
                calls = [rows[k][2] for k in run]  # one adapter set: the batching never mixes sets
                self.adapters.activate(self.pipe, self.adapters.paths(calls[0].get("loras", ())))
                for k, image in zip(run, rq.run(self.pipe, calls)):
                    images.setdefault(rows[k][0], {})[rows[k][1]] = image
            except (ValueError, ManifestError) as e:
                if len(run) > 1:  # a bad row among several requests: each alone, so that only its own fails
                    for k in run:
                        attempt([k])
                    return
                answers[rows[run[0]][0]] = _error(e, pb_utils.TritonError.INVALID_ARG)
            except Exception as e:  # the next request must still be served: these fail alone
                for r in owners:
                    answers[r] = _error(e, pb_utils.TritonError.INTERNAL)

        for run in rq.groups([call for _, _, call in rows], self.max_images, self.batched):
            attempt(run)
        for r in range(len(requests)):
            if answers[r] is None:
                per_prompt = [images[r][i] for i in sorted(images[r])]
                if self.pipe.layout.video:  # at the rate the model was told (LTX's frame_rate), else the card's
                    fps = next(call for owner, _, call in rows if owner == r).get("frame_rate") or \
                        self.pipe.constants["fps"]
                    answers[r] = _videos(per_prompt, requests[r], fps)
                else:
                    answers[r] = _images(per_prompt)
        return answers

    def finalize(self):
        self.pipe.close()


def _images(per_prompt: list[np.ndarray]):
    shapes = {image.shape for image in per_prompt}
    if len(shapes) > 1:
        return _error(ValueError(f"the rows of one request made images of shapes {sorted(shapes)}: rows must share "
                                 "height, width and num_images_per_prompt (send separate requests)"),
                      pb_utils.TritonError.INVALID_ARG)
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(rq.OUTPUT.name, np.stack(per_prompt))])


def _videos(per_prompt: list[np.ndarray], request, fps: float):
    """Each row's videos' frames, and their mp4 files where the request asks for that output."""
    shapes = {frames.shape for frames in per_prompt}
    if len(shapes) > 1:
        return _error(ValueError(f"the rows of one request made videos of shapes {sorted(shapes)}: rows must share "
                                 "num_frames, height, width and num_videos_per_prompt (send separate requests)"),
                      pb_utils.TritonError.INVALID_ARG)
    frames, mp4 = rq.VIDEO_OUTPUTS
    outputs = [pb_utils.Tensor(frames.name, np.stack(per_prompt))]
    if mp4.name in request.requested_output_names():
        files = [[mp4_bytes(video, fps) for video in row] for row in per_prompt]
        outputs.append(pb_utils.Tensor(mp4.name, np.array(files, dtype=object)))
    return pb_utils.InferenceResponse(output_tensors=outputs)


def _error(e: Exception, code):
    message = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))
