"""python -m runners triton ARTIFACT --out REPO: write a Triton model repository.
python -m runners serve ARTIFACT: serve the artifact with Triton (KServe v2 over HTTP and gRPC).
python -m runners openai ARTIFACT: serve it as an OpenAI-compatible images API (openai_api.py).
They mirror `write_repository`, `Server` and `openai_api.serve`; `serve` writes the python layout in a temporary
folder, referencing the artifact in place, and runs until Ctrl-C."""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from runners.cli import run_cli
from runners.manifest import ManifestError


def _adapter_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None, help="CPU threads of each engine session")
    p.add_argument("--lora-dir", default=None, help="a folder of LoRA adapters (.safetensors) that each request may "
                   "name in its `loras` field, e.g. '[{\"name\": \"style\", \"scale\": 0.8}]'")
    p.add_argument("--max-loras", type=int, default=4, help="adapters a request may name at once")
    p.add_argument("--lora-cache-mib", type=int, default=2048,
                   help="memory for the adapted weights of recently used adapter sets (the current set's is kept)")


def _repository_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", help="an artifact folder, e.g. build/sd3-tiny/ort-fp32")
    p.add_argument("--model-name", default=None, help="the Triton model's name (default: the artifact's model)")
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="prompts a Triton batch holds (default: what one denoiser call of the artifact takes)")
    p.add_argument("--instances", type=int, default=1, help="Pipeline copies per device (instance_group count)")
    p.add_argument("--batch-requests", action="store_true",
                   help="run queued requests with equal settings as one Pipeline call (one denoiser batch)")
    p.add_argument("--queue-delay-us", type=int, default=2000,
                   help="how long Triton's dynamic batcher waits to fill a batch, in microseconds")
    _adapter_options(p)


def _repository_kwargs(args) -> dict:
    return {"model_name": args.model_name, "max_batch_size": args.max_batch_size, "instances": args.instances,
            "batch_requests": args.batch_requests, "queue_delay_us": args.queue_delay_us, "threads": args.threads,
            "lora_dir": args.lora_dir, "max_loras": args.max_loras, "lora_cache_mib": args.lora_cache_mib}


def triton(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m runners triton", description=__doc__)
    _repository_options(p)
    p.add_argument("--out", required=True, help="the repository folder to write (replaced whole)")
    p.add_argument("--layout", choices=("python", "native"), default="python",
                   help="python: one Python-backend model holding the artifact (runs on any Triton); native: each "
                        "engine a model of Triton's onnxruntime/tensorrt/openvino backend, called through BLS")
    p.add_argument("--reference-artifact", action="store_true",
                   help="python layout: the config names the artifact's path instead of holding a copy")
    p.add_argument("--kserve", metavar="STORAGE_URI", default=None,
                   help="also write REPO/inferenceservice.json, a KServe InferenceService for the Triton runtime "
                        "reading the repository from STORAGE_URI (e.g. s3://bucket/model_repository)")
    args = p.parse_args(argv)
    if args.kserve and args.reference_artifact:
        p.error("--kserve serves the repository from storage: it must hold the artifact, not name its path here "
                "(drop --reference-artifact)")

    def write():
        from runners.serving.kserve import write_inference_service
        from runners.serving.repository import describe, write_repository

        model = write_repository(args.artifact, args.out, layout=args.layout,
                                 reference_artifact=args.reference_artifact, **_repository_kwargs(args))
        if args.kserve:
            write_inference_service(args.out, model.name, args.kserve, args.artifact)
        print(f"wrote {args.out} ({args.layout} layout):\n{describe(Path(args.out))}")
        print(f"serve it: tritonserver --model-repository {Path(args.out).resolve()}")

    return run_cli(write, (ManifestError, ValueError), "no repository was written")


def serve(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m runners serve", description=__doc__)
    _repository_options(p)
    p.add_argument("--host", default="127.0.0.1", help="the address every endpoint binds (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port; gRPC is PORT+1, metrics PORT+2")
    args = p.parse_args(argv)

    def run():
        import signal

        from runners.serving.repository import write_repository
        from runners.serving.server import Server

        def stop(*_):  # SIGTERM (docker stop, systemd, kill) stops the server as Ctrl-C does
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, stop)
        with tempfile.TemporaryDirectory(prefix="diffusion-aot-repository-") as scratch:
            model = write_repository(args.artifact, Path(scratch) / "repository", reference_artifact=True,
                                     **_repository_kwargs(args))
            server = Server(model.parent, host=args.host, http_port=args.port, grpc_port=args.port + 1,
                            metrics_port=args.port + 2)
            print(f"starting Triton on {args.artifact} (log: {server.log}) ...", flush=True)
            with server:
                print(f"serving model {model.name!r}: HTTP http://{server.http_url}/v2/models/{model.name}, gRPC "
                      f"{server.grpc_url}, metrics http://{args.host}:{server.metrics_port}/metrics; Ctrl-C stops",
                      flush=True)
                while server.process.poll() is None:
                    time.sleep(0.5)
                raise RuntimeError(f"tritonserver exited with code {server.process.returncode}; its log ends:\n"
                                   f"{server.log_tail()}")

    return run_cli(run, (ManifestError, ValueError, RuntimeError), "the server was stopped and its temporary "
                   "repository removed")


def openai(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m runners openai", description=__doc__)
    p.add_argument("artifact", help="an artifact folder, e.g. build/sd3-tiny/ort-fp32")
    p.add_argument("--model-name", default=None, help="the model's name in requests (default: the artifact's model)")
    p.add_argument("--host", default="127.0.0.1", help="the address it binds (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    _adapter_options(p)
    args = p.parse_args(argv)

    def run():
        from runners import Pipeline
        from runners.serving.adapters import AdapterSets
        from runners.serving.openai_api import serve as serve_api

        with Pipeline.load(args.artifact, threads=args.threads) as pipe:
            name = args.model_name or pipe.manifest["model"]["name"]
            sets = AdapterSets(args.lora_dir, args.max_loras, args.lora_cache_mib * 2**20) if args.lora_dir else None
            print(f"serving {name!r} at http://{args.host}:{args.port}/v1/images/generations and /v1/images/edits; "
                  "Ctrl-C stops", flush=True)
            serve_api(pipe, name, host=args.host, port=args.port, adapter_sets=sets)

    return run_cli(run, (ManifestError, ValueError, RuntimeError), "the server was stopped")


COMMANDS = {"triton": triton, "serve": serve, "openai": openai}
