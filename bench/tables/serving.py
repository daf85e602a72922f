"""The Triton serving table: the artifact served by `runners.serving` (python layout, tritonserver on
127.0.0.1) under 1, 4 and 8 concurrent HTTP clients, against calling the Pipeline directly in a
fresh process; with and without batching queued requests into one Pipeline call; and with adapters
chosen per request (`--lora-dir`) against the same requests without them."""
from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench.harness import in_child, log
from bench.tables import Table


def _direct_seconds(artifact: str, size: int, steps: int, requests: int) -> list[float]:
    """Latencies of `requests` Pipeline calls in this (fresh) process, after one warm-up call."""
    from runners import Pipeline

    with Pipeline.load(artifact) as pipe:
        pipe("a photo of a cat", seed=0, height=size, width=size, num_inference_steps=steps)
        times = []
        for i in range(requests):
            t0 = time.perf_counter()
            pipe("a photo of a cat", seed=i, height=size, width=size, num_inference_steps=steps)
            times.append(time.perf_counter() - t0)
    return times


def _inputs(size: int, steps: int, seed: int, loras: str | None = None) -> list:
    """One request's tensors; `loras`: its adapters field (JSON), when it names any."""
    import tritonclient.http as http

    tensors = []
    adapters = (("loras", loras.encode(), object),) if loras else ()
    for name, value, dtype in (("prompt", b"a photo of a cat", object), ("height", size, np.int32),
                               ("width", size, np.int32), ("num_inference_steps", steps, np.int32),
                               ("seed", seed, np.int64), *adapters):
        array = np.full((1, 1), value, dtype=dtype)
        tensor = http.InferInput(name, [1, 1], {object: "BYTES", np.int32: "INT32", np.int64: "INT64"}[dtype])
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def _load(server, model: str, clients: int, requests: int, size: int, steps: int, adapter_sets=(None,)) -> dict:
    """`requests` requests spread over `clients` threads, each with its own connection; request i names
    the adapters `adapter_sets[i % len(adapter_sets)]` (a loras field, or None)."""
    import tritonclient.http as http

    latencies, errors = [], []
    lock = threading.Lock()

    def client(seeds):
        connection = http.InferenceServerClient(server.http_url, network_timeout=3600, connection_timeout=60)
        for seed in seeds:
            t0 = time.perf_counter()
            try:
                connection.infer(model, _inputs(size, steps, seed, adapter_sets[seed % len(adapter_sets)]))
                with lock:
                    latencies.append(time.perf_counter() - t0)
            except Exception as e:  # counted in the table
                with lock:
                    errors.append(repr(e))
        connection.close()  # an idle keep-alive connection would hold the server's exit for its whole timeout

    seeds = list(range(requests))
    threads = [threading.Thread(target=client, args=(seeds[c::clients],)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"wall": wall, "latencies": latencies, "errors": errors}


def _row(runner: str, batched: bool, clients: int, run: dict, peak: float, direct: float) -> list[str]:
    lat = sorted(run["latencies"]) or [float("nan")]
    p50, p95 = statistics.median(lat), lat[min(len(lat) - 1, int(0.95 * len(lat)))]
    overhead = f"{p50 / direct - 1:+.1%}" if clients == 1 else "-"
    return [runner, "on" if batched else "off", str(clients), f"{60 * len(run['latencies']) / run['wall']:.2f}",
            f"{p50:.2f}", f"{p95:.2f}", str(len(run["errors"])), f"{peak:.0f}", overhead]


def _adapter_rows(artifact: Path, checkpoint: Path, concurrency: list[int], requests: int, size: int, steps: int,
                  direct: float) -> list[list[str]]:
    """One server with a --lora-dir of two adapters: the same requests without adapters, then naming
    adapter a, b and none in turn (each switch between two executions)."""
    from bench.tables.lora import make_adapter
    from runners.serving.repository import write_repository
    from runners.serving.server import Server, free_ports

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-serving-loras-") as scratch:
        loras = Path(scratch) / "loras"
        loras.mkdir()
        for seed, name in enumerate(("a", "b")):
            make_adapter(checkpoint, loras / f"{name}.safetensors", seed=seed)
        model = write_repository(artifact, Path(scratch) / "repo", reference_artifact=True, lora_dir=str(loras))
        sets = {"no adapters": (None,), "adapters a, b, none in turn": ('[{"name": "a", "scale": 0.8}]',
                                                                        '[{"name": "b", "scale": 0.8}]', None)}
        for clients in [c for c in concurrency if c in (1, 4)] or concurrency[:1]:
            http_port, grpc_port, metrics_port = free_ports(3)
            with Server(model.parent, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port) as server:
                _load(server, model.name, 1, 1, size, steps)  # warm-up
                for label, adapter_sets in sets.items():
                    log(f"serving: {requests} requests from {clients} clients, --lora-dir, {label}")
                    got = _load(server, model.name, clients, requests, size, steps, adapter_sets)
                    rows.append(_row(f"Triton, python layout, --lora-dir: {label}", False, clients, got,
                                     server.rss_bytes("VmHWM") / 2**20, direct))
    return rows


def measure(run) -> list[dict]:
    from runners.serving.repository import write_repository
    from runners.serving.server import Server, free_ports

    a, artifact = run.args, run.default_artifact
    size, steps, requests = a.serving_size, a.serving_steps, a.serving_requests
    concurrency = [int(c) for c in a.serving_clients.split(",")]
    log(f"serving: {requests} direct Pipeline calls at {size}x{size}, {steps} steps")
    direct = statistics.median(in_child(_direct_seconds, str(artifact), size, steps, requests))
    rows = [["Pipeline, direct", "-", "1", f"{60 / direct:.2f}", f"{direct:.2f}", "-", "0", "-", "-"]]
    for batched in (False, True):
        with tempfile.TemporaryDirectory(prefix="bench-serving-") as scratch:
            model = write_repository(artifact, Path(scratch) / "repo", reference_artifact=True,
                                     batch_requests=batched)
            for clients in [c for c in concurrency if c > 1 or not batched]:  # one client batches nothing
                http_port, grpc_port, metrics_port = free_ports(3)
                with Server(model.parent, http_port=http_port, grpc_port=grpc_port,
                            metrics_port=metrics_port) as server:
                    _load(server, model.name, 1, 1, size, steps)  # warm-up
                    log(f"serving: {requests} requests from {clients} clients, batching {'on' if batched else 'off'}")
                    got = _load(server, model.name, clients, requests, size, steps)
                    peak = server.rss_bytes("VmHWM") / 2**20
                rows.append(_row("Triton, python layout", batched, clients, got, peak, direct))
    rows += _adapter_rows(artifact, run.src.folder / "transformer", concurrency, requests, size, steps, direct)
    return [{"title": f"Serving with Triton at {size}x{size}, {steps} steps (ort-fp32, HTTP on 127.0.0.1)",
            "columns": ["runner", "batching", "clients", "images / min", "p50 s", "p95 s", "errors",
                        "peak RSS MiB", "overhead vs direct (p50)"],
            "rows": rows,
            "notes": [f"{requests} requests per row (seeds 0 to {requests - 1}), spread over the clients, each a thread "
                      "with its own connection; one request is one prompt, guidance on, one image. Every row but the "
                      "first is a fresh tritonserver (`runners.serving.Server`, the nvidia-pytriton wheel's) on a "
                      "repository written by `write_repository(..., reference_artifact=True)`, after one warm-up "
                      "request. The direct row is the median of as many `Pipeline` calls in a fresh process, after "
                      "one warm-up. p95 is the nearest rank. Peak RSS: the server and its model process, each one's "
                      "VmHWM, summed. Batching on: queued requests with equal settings run as one Pipeline call "
                      "(`--batch-requests`), at most what one denoiser call of the artifact takes.",
                      "The --lora-dir rows: one server (at 1 and at 4 clients) whose folder holds two random rank-16 "
                      "adapters on the transformer's attention (the LoRA table's); first the same requests naming "
                      "no adapter, then requests naming adapter a, b (scale 0.8) and none in turn, so that nearly "
                      "every execution switches (the adapted weights of a set are kept for the next time it comes: "
                      "`--lora-cache-mib`). Peak RSS is the server's after both runs."]}]


def _arguments(group) -> None:
    group.add_argument("--serving-size", type=int, default=512, help="image side of the serving table's requests")
    group.add_argument("--serving-steps", type=int, default=4, help="steps of the serving table's requests")
    group.add_argument("--serving-requests", type=int, default=8, help="requests per row of the serving table")
    group.add_argument("--serving-clients", default="1,4,8", help="the serving table's numbers of concurrent clients")


TABLE = Table("serving", "Serving with Triton", "a Triton model repository of the default artifact", ("sd3",),
              measure, _arguments, smoke=("--serving-size", "64", "--serving-steps", "1", "--serving-requests", "4",
                                          "--serving-clients", "2"))
