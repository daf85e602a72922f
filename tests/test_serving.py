"""Triton serving (runners/serving): the python layout served by a real tritonserver on 127.0.0.1
gives the Pipeline's own images, under concurrency, bad requests and faults; both layouts' configs
parse as Triton's ModelConfig; the KServe manifest passes KServe's schema. Every server is stopped
by its fixture."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tritonclient_grpc
import tritonclient.http as tritonclient_http
from conftest import server_for
from tritonclient.utils import InferenceServerException

from runners import Pipeline
from runners.serving.repository import write_repository
from runners.serving.server import free_port_block

SIZE, STEPS = 64, 2  # the smallest sd3-tiny image, so that a request takes tens of ms
RAISE = "raise inside execute"
# The test's fault: a model whose execute raises (not a request it answers with an error).
FAULTY_MODEL = f'''

import triton_python_backend_utils as pb_utils  # noqa: E402

_Model = TritonPythonModel


class TritonPythonModel(_Model):
    def execute(self, requests):
        for request in requests:
            prompt = pb_utils.get_input_tensor_by_name(request, "prompt")
            if prompt is not None and prompt.as_numpy().reshape(-1)[0] == {RAISE.encode()!r}:
                raise RuntimeError("the test's fault")
        return super().execute(requests)
'''


@pytest.fixture(scope="module")
def served(tiny_artifact, tmp_path_factory):
    repo = tmp_path_factory.mktemp("serving") / "repository"
    model = write_repository(tiny_artifact, repo)
    with open(model / "1" / "model.py", "a") as f:
        f.write(FAULTY_MODEL)
    with server_for(repo) as server:
        yield server, model.name


@pytest.fixture(scope="module")
def pipe(tiny_artifact):
    with Pipeline.load(tiny_artifact) as pipe:
        yield pipe


def _inputs(module, prompt: bytes | str = "a cat", rows: int = 1, **fields) -> list:
    """A request: `prompt` in `rows` batch rows, and each field (name: (numpy dtype, value)) in every row."""
    values = {"prompt": (object, prompt.encode() if isinstance(prompt, str) else prompt),
              "height": (np.int32, SIZE), "width": (np.int32, SIZE), "num_inference_steps": (np.int32, STEPS),
              **fields}
    tensors = []
    for name, spec in values.items():
        if spec is None:
            continue
        dtype, value = spec
        array = np.full((rows, 1), value, dtype=dtype)
        triton_type = "BYTES" if dtype is object else {np.int32: "INT32", np.int64: "INT64",
                                                         np.float32: "FP32"}[dtype]
        tensor = module.InferInput(name, list(array.shape), triton_type)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def _reference(pipe, prompt="a cat", seed=0, **kwargs) -> np.ndarray:
    return np.asarray(pipe(prompt, seed=seed, height=SIZE, width=SIZE, num_inference_steps=STEPS, **kwargs)[0])


def _image(client, model, prompt="a cat", seed=0, **kwargs) -> np.ndarray:
    module = tritonclient_grpc if isinstance(client, tritonclient_grpc.InferenceServerClient) else tritonclient_http
    result = client.infer(model, _inputs(module, prompt, seed=(np.int64, seed)), **kwargs)
    images = result.as_numpy("images")
    assert images.shape == (1, 1, SIZE, SIZE, 3) and images.dtype == np.uint8
    return images[0, 0]


def test_served_image_is_the_pipelines_over_http_and_grpc(served, pipe):
    server, model = served
    reference = _reference(pipe, seed=7)
    assert np.array_equal(_image(tritonclient_http.InferenceServerClient(server.http_url), model, seed=7), reference)
    assert np.array_equal(_image(tritonclient_grpc.InferenceServerClient(server.grpc_url), model, seed=7), reference)
    client = tritonclient_http.InferenceServerClient(server.http_url)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(model)
    import urllib.request

    with urllib.request.urlopen(f"http://{server.host}:{server.metrics_port}/metrics", timeout=5) as response:
        assert f'nv_inference_request_success{{model="{model}"'.encode() in response.read()


def test_eight_clients_four_requests_each(served, pipe):
    server, model = served
    jobs = [(f"prompt {c}", 100 * c + r) for c in range(8) for r in range(4)]
    references = {job: _reference(pipe, *job) for job in jobs}
    results, errors = {}, []

    def client(jobs_of_client):
        http = tritonclient_http.InferenceServerClient(server.http_url, network_timeout=120)
        for job in jobs_of_client:
            try:
                results[job] = _image(http, model, *job)
            except Exception as e:  # counted: a lost or failed request fails the test below
                errors.append((job, e))

    threads = [threading.Thread(target=client, args=(jobs[4 * c:4 * c + 4],)) for c in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(results) == sorted(jobs)
    wrong = [job for job in jobs if not np.array_equal(results[job], references[job])]
    assert not wrong, f"responses differing from the Pipeline's image: {wrong}"
    assert server.ready()


def _statistics_of(http, model: str, inferences: int, timeout: float = 30.0) -> dict:
    """The model's statistics once they count `inferences` requests: Triton can count a batch after its responses
    have gone out (seen in a full suite on a busy machine: a query right after the last response read 0 executions
    and 0 inferences)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = http.get_inference_statistics(model)["model_stats"][0]
        if stats["inference_count"] >= inferences or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_batching_requests_gives_each_its_image(tiny_artifact, tmp_path, pipe):
    """--batch-requests: concurrent requests run as shared Pipeline calls, and each gets its own image (up to the
    batch-dependent rounding test_batched_calls_equal_each_call_alone bounds)."""
    model = write_repository(tiny_artifact, tmp_path / "repo", batch_requests=True, queue_delay_us=200_000)
    jobs = [(f"prompt {i}", i) for i in range(4)]
    results = {}

    def client(job):
        results[job] = _image(tritonclient_http.InferenceServerClient(server.http_url), model.name, *job)

    with server_for(model.parent) as server:
        threads = [threading.Thread(target=client, args=(job,)) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = _statistics_of(tritonclient_http.InferenceServerClient(server.http_url), model.name, len(jobs))
    assert stats["execution_count"] < stats["inference_count"] == len(jobs)  # some requests ran together
    worst = max(int(np.abs(results[job].astype(int) - _reference(pipe, *job)).max()) for job in jobs)
    assert worst <= 1, f"served images differ from the Pipeline's by {worst}/255"


BAD_REQUESTS = {  # name: (fields of the request, what the error must name)
    "missing prompt": (dict(prompt=None), "prompt is missing"),
    "off-grid size": (dict(height=(np.int32, 65)), "height=65"),
    "too large a size": (dict(width=(np.int32, 4096)), "width=4096"),
    "zero steps": (dict(num_inference_steps=(np.int32, 0)), "num_inference_steps=0"),
    "a million steps": (dict(num_inference_steps=(np.int32, 10**6)), "num_inference_steps=1000000"),
    "non-UTF-8 prompt": (dict(prompt=(object, b"\xff\xfe cat")), "prompt[0] is not UTF-8"),
    "wrong dtype": (dict(seed=(np.int32, 1)), "'seed'"),
    "huge batch": (dict(rows=1000), "batch-size must be <= 4"),
    "huge images per prompt": (dict(num_images_per_prompt=(np.int32, 10**6)), "num_images_per_prompt"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_request_names_its_field_and_the_next_succeeds(served, pipe, case):
    server, model = served
    fields, named = BAD_REQUESTS[case]
    fields = dict(fields)
    rows = fields.pop("rows", 1)
    prompt = fields.pop("prompt", (object, b"a cat"))
    inputs = _inputs(tritonclient_http, "a cat", rows, **fields)
    if prompt is None:
        inputs = [i for i in inputs if i.name() != "prompt"]
    else:
        inputs[0].set_data_from_numpy(np.full((rows, 1), prompt[1], dtype=object))
    client = tritonclient_http.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException) as error:
        client.infer(model, inputs)
    assert (error.value.status(), named in error.value.message()) == ("400", True), error.value.message()
    assert np.array_equal(_image(client, model, seed=3), _reference(pipe, seed=3))


def _good_request(server, model, pipe_image) -> None:
    image = _image(tritonclient_http.InferenceServerClient(server.http_url), model, seed=5)
    assert np.array_equal(image, pipe_image)


def test_faults_leave_the_server_answering_without_growing(served, pipe):
    server, model = served
    good = _reference(pipe, seed=5)
    long = {"num_inference_steps": (np.int32, 60)}  # a quarter of a second of work, to walk away from
    http = tritonclient_http.InferenceServerClient(server.http_url)

    def disconnect():  # the client gives up after 0.05 s and closes its connection
        impatient = tritonclient_http.InferenceServerClient(server.http_url, network_timeout=0.05)
        with pytest.raises(Exception):
            impatient.infer(model, _inputs(tritonclient_http, **long))

    def time_out():  # gRPC's deadline: the server is told the request is over
        grpc = tritonclient_grpc.InferenceServerClient(server.grpc_url)
        with pytest.raises(InferenceServerException, match="Deadline"):
            grpc.infer(model, _inputs(tritonclient_grpc, **long), client_timeout=0.05)

    def raise_inside():
        with pytest.raises(InferenceServerException, match="the test's fault"):
            http.infer(model, _inputs(tritonclient_http, RAISE))

    faults = (disconnect, time_out, raise_inside)
    for fault in faults:  # warm-up: every kind once, so that what is cached is in the baseline
        fault()
        _good_request(server, model, good)
    # Three rounds: the first may still fill caches (the allocator's, Triton's) under a loaded machine, and
    # one round's RSS moves by a few MiB either way (measured: -2.0, +4.0 and +13.5 MiB on a 2-core machine);
    # a leak grows in every round, so the smaller growth of the last two is held to the bound.
    rss = [server.rss_bytes()]
    for _ in range(3):
        for i in range(30):
            faults[i % 3]()
            _good_request(server, model, good)
        rss.append(server.rss_bytes())
    assert server.ready()
    print(f"server RSS {rss[0] / 2**20:.1f} MiB before 90 faults (each followed by a good request), then per 30: "
          + ", ".join(f"{(b - a) / 2**20:+.2f} MiB" for a, b in zip(rss, rss[1:])))
    growth = min(rss[2] - rss[1], rss[3] - rss[2])  # shown by `pytest -s -k faults tests/test_serving.py`
    assert growth < 0.05 * rss[1], f"RSS grew {growth / 2**20:.1f} MiB over each of the last two rounds of 30 faults"


def _model_config(path: Path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def test_python_layout_config_and_files(tiny_artifact, tmp_path):
    model = write_repository(tiny_artifact, tmp_path / "repo", max_batch_size=3, instances=2, batch_requests=True)
    config = _model_config(model / "config.pbtxt")
    assert (config.name, config.backend, config.max_batch_size) == (model.name, "python", 3)
    # the family's declared options (runners/options.py) a server takes, then the server's own
    assert [i.name for i in config.input] == ["prompt", "negative_prompt", "height", "width", "num_inference_steps",
                                              "num_images_per_prompt", "seed", "vae_tiling", "guidance_scale",
                                              "max_sequence_length", "image", "mask_image", "strength", "cache",
                                              "loras"]
    assert [i.name for i in config.input if not i.optional] == ["prompt"]
    (output,) = config.output
    assert (output.name, list(output.dims)) == ("images", [-1, -1, -1, 3])
    assert config.HasField("dynamic_batching") and config.instance_group[0].count == 2
    assert config.parameters["batch_requests"].string_value == "true"
    copied = model / "1" / "artifact" / "transformer.onnx"
    assert copied.stat().st_ino == (tiny_artifact / "transformer.onnx").stat().st_ino  # a hard link
    assert (model / "1" / "runners" / "serving" / "triton_model.py").is_file()
    Pipeline.load(model / "1" / "artifact").close()  # the copy is a whole artifact


def test_native_layout_configs_and_what_this_server_can_load(tiny_artifact, tmp_path):
    repo = tmp_path / "native"
    pipeline_model = write_repository(tiny_artifact, repo, layout="native")
    source = json.loads((tiny_artifact / "manifest.json").read_text())
    for sub, entry in source["submodules"].items():
        config = _model_config(repo / f"{pipeline_model.name}_{sub}" / "config.pbtxt")
        assert (config.backend, config.max_batch_size, config.default_model_filename) == ("onnxruntime", 0,
                                                                                        entry["file"])
        assert [i.name for i in config.input] == [i["name"] for i in entry["inputs"]]
        assert [o.name for o in config.output] == [o["name"] for o in entry["outputs"]]
        assert all(-1 in i.dims for i in config.input)  # every engine input has a dynamic axis here
    manifest = json.loads((pipeline_model / "1" / "artifact" / "manifest.json").read_text())
    assert {s["target"] for s in manifest["submodules"].values()} == {"triton"}
    assert not any(f.endswith(".onnx") for f in manifest["files"])
    # This tritonserver has only the Python backend: the pipeline model loads, and each engine model's
    # config is read and then stops at its missing backend (a malformed config would stop earlier).
    with server_for(repo, extra_args=["--exit-on-error=false", "--strict-readiness=false"]) as server:
        index = {m["name"]: m for m in tritonclient_http.InferenceServerClient(server.http_url)
                 .get_model_repository_index()}
    assert index[pipeline_model.name]["state"] == "READY"
    for sub in source["submodules"]:
        engine = index[f"{pipeline_model.name}_{sub}"]
        assert engine["state"] == "UNAVAILABLE" and "onnxruntime" in engine["reason"], engine


def test_gpu_and_openvino_artifacts_configs_and_engine_files():
    """What TensorRT and OpenVINO artifacts get (no such server here): GPU instances and tensorrt_plan for
    TensorRT, and every file of an engine moves with it (OpenVINO's .bin beside its .xml)."""
    from runners.serving.repository import _engine_files, engine_config, pipeline_config

    entry = {"file": "transformer.trt1.7.plan", "dims": {"batch": [1, 2, 8]},
             "inputs": [{"name": "x", "dtype": "float16", "shape": ["batch", 16]}],
             "outputs": [{"name": "y", "dtype": "float16", "shape": ["batch", 16]}]}
    manifest = {"target": "trt-rtx", "backend": "trt-rtx", "model": {"family": "sd3"},
                "submodules": {"transformer": entry}}
    assert "kind: KIND_GPU count: 2" in pipeline_config("m", manifest, 4, 2, 0, {})
    engine = engine_config("m_transformer", "trt-rtx", entry)
    assert 'platform: "tensorrt_plan"' in engine and "kind: KIND_GPU" in engine
    assert '{ name: "x" data_type: TYPE_FP16 dims: [ -1, 16 ] }' in engine
    files = ["text_encoder.xml", "text_encoder.bin", "text_encoder_2.xml", "text_encoder_2.bin",
             "text_encoder.GPU.blob", "tokenizer/tokenizer.json"]
    assert _engine_files({"files": files}, {"file": "text_encoder.xml"}) == [
        "text_encoder.xml", "text_encoder.bin", "text_encoder.GPU.blob"]
    assert _engine_files({"files": ["vae_decoder.onnx", "vae_decoder.onnx.data"]}, {"file": "vae_decoder.onnx"}) == [
        "vae_decoder.onnx", "vae_decoder.onnx.data"]


def test_kserve_manifest_passes_kserve_schema(tiny_artifact, tmp_path, capsys):
    import jsonschema

    from runners.__main__ import main

    assert main(["triton", str(tiny_artifact), "--out", str(tmp_path / "repo"), "--kserve", "s3://bucket/repo"]) == 0
    assert "sd3-tiny: \"python\"" in capsys.readouterr().out
    service = json.loads((tmp_path / "repo" / "inferenceservice.json").read_text())
    schema = json.loads((Path(__file__).parent / "data" / "kserve_inferenceservice_v1beta1.schema.json").read_text())
    jsonschema.validate(service, schema)
    assert service["spec"]["predictor"]["model"]["storageUri"] == "s3://bucket/repo"
    service["spec"]["predictor"]["model"]["storgeUri"] = "typo"  # the schema can fail
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(service, schema)


def test_repository_errors_write_nothing(tiny_artifact, tmp_path, capsys):
    from runners.__main__ import main

    out = tmp_path / "repo"
    assert main(["triton", str(tiny_artifact), "--out", str(out), "--instances", "0"]) == 2
    assert "instances=0 is not allowed" in capsys.readouterr().err
    assert main(["triton", str(tmp_path), "--out", str(out)]) == 2
    assert "manifest.json is missing" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_code:
        main(["triton", str(tiny_artifact), "--out", str(out), "--kserve", "s3://b/r", "--reference-artifact"])
    assert exit_code.value.code == 2 and "drop --reference-artifact" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".repo*"))


def test_groups_share_settings_and_fit_the_denoiser():
    from runners.serving.requests import groups

    calls = [dict(prompt="a", seed=1), dict(prompt="b", seed=2, negative_prompt="x"),
             dict(prompt="c", seed=3, height=128), dict(prompt="d", seed=4), dict(prompt="e", seed=5, image=object())]
    assert groups(calls, max_images=2, batched=True) == [[0, 1], [2], [3], [4]]
    assert groups(calls, max_images=2, batched=False) == [[0], [1], [2], [3], [4]]
    assert groups([dict(prompt="a", seed=1, num_images_per_prompt=2)] * 2, max_images=3, batched=True) == [[0], [1]]


def test_controlnet_options_are_inputs_of_an_artifact_with_controlnets():
    """Per-ControlNet options have one more dimension; a row's values become the call's list (one number: every
    ControlNet's). An artifact without ControlNets has none of their inputs."""
    from runners.serving.requests import batch_key, calls, inputs_for

    plain = {"model": {"family": "flux"}, "submodules": {"transformer": {}, "vae_encoder": {}}}
    controlled = {**plain, "submodules": {**plain["submodules"], "controlnet": {}, "controlnet_1": {}}}
    assert not {"control_image", "control_mode"} & {t.name for t in inputs_for(plain)}
    inputs = {t.name: t for t in inputs_for(controlled)}
    assert inputs["control_image"].dims == (-1, -1, -1, 3) and inputs["control_image"].data_type == "TYPE_UINT8"
    assert inputs["controlnet_conditioning_scale"].dims == inputs["control_mode"].dims == (-1,)
    assert inputs["control_guidance_start"].dims == (1,)
    images = np.zeros((2, 2, 8, 16, 3), np.uint8)
    rows = calls({"prompt": np.array([[b"a"], [b"b"]], object), "control_image": images,
                  "controlnet_conditioning_scale": np.array([[0.5], [0.25]], np.float32),
                  "control_mode": np.array([[1, 2], [3, 4]], np.int32)})
    assert [len(r["control_image"]) for r in rows] == [2, 2] and rows[0]["control_image"][1].size == (16, 8)
    assert [r["controlnet_conditioning_scale"] for r in rows] == [0.5, 0.25]
    assert [r["control_mode"] for r in rows] == [[1, 2], [3, 4]]
    assert batch_key(dict(prompt="a", seed=1, controlnet_conditioning_scale=[0.5, 1.0])) is None  # runs alone


def test_batched_calls_equal_each_call_alone(pipe):
    """--batch-requests: one Pipeline call for several requests gives each the image it gets alone, up to
    the kernels' batch-dependent rounding."""
    from runners.serving.requests import run

    settings = {"height": SIZE, "width": SIZE, "num_inference_steps": STEPS}
    calls = [{"prompt": f"prompt {i}", "seed": 10 + i, **settings} for i in range(3)]
    calls.append({"prompt": "prompt 0", "negative_prompt": "blurry", "seed": 99, **settings})
    together = run(pipe, calls)
    alone = [run(pipe, [call])[0] for call in calls]
    assert np.array_equal(alone[0][0], _reference(pipe, "prompt 0", seed=10))
    worst = max(int(np.abs(t.astype(int) - a).max()) for t, a in zip(together, alone))
    assert worst <= 1, f"batched images differ from single ones by {worst}/255"


# The test's stand-in for Triton's onnxruntime backend, which this tritonserver lacks: a Python-backend
# model with the engine model's own inputs and outputs, running its .onnx in ONNX Runtime.
ENGINE_DOUBLE = '''import json
from pathlib import Path

import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        (engine,) = (Path(args["model_repository"]) / args["model_version"]).glob("*.onnx")
        self.session = ort.InferenceSession(str(engine))
        self.inputs = [i["name"] for i in config["input"]]
        self.outputs = [o["name"] for o in config["output"]]

    def execute(self, requests):
        answers = []
        for request in requests:
            feeds = {n: pb_utils.get_input_tensor_by_name(request, n).as_numpy() for n in self.inputs}
            results = self.session.run(self.outputs, feeds)
            answers.append(pb_utils.InferenceResponse([pb_utils.Tensor(n, r) for n, r in zip(self.outputs, results)]))
        return answers
'''


def test_native_layout_serves_the_pipelines_image_through_bls(tiny_artifact, tmp_path, pipe):
    repo = tmp_path / "native"
    pipeline_model = write_repository(tiny_artifact, repo, layout="native")
    for config_path in repo.glob(f"{pipeline_model.name}_*/config.pbtxt"):
        config = config_path.read_text().replace('backend: "onnxruntime"', 'backend: "python"')
        config_path.write_text("\n".join(line for line in config.splitlines()
                                         if not line.startswith("default_model_filename")) + "\n")
        (config_path.parent / "1" / "model.py").write_text(ENGINE_DOUBLE)
    with server_for(repo) as server:
        image = _image(tritonclient_http.InferenceServerClient(server.http_url), pipeline_model.name, seed=11)
    assert np.array_equal(image, _reference(pipe, seed=11))


def test_serve_command_serves_until_stopped(tiny_artifact):
    """`python -m runners serve`: ready on 127.0.0.1, and SIGTERM (as Ctrl-C) stops Triton and leaves nothing running."""
    import signal
    import subprocess
    import sys
    import time

    port = free_port_block(3)  # gRPC and metrics take the next two
    command = [sys.executable, "-m", "runners", "serve", str(tiny_artifact), "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    printed = ""
    try:
        client = tritonclient_http.InferenceServerClient(f"127.0.0.1:{port}")
        deadline = time.monotonic() + 120
        while not _ready(client) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.3)
        assert client.is_model_ready("sd3-tiny")
        client.close()
        # The command prints its line once its own readiness check returns, which can come after ours.
        while "serving model" not in printed and process.poll() is None:
            printed += process.stdout.readline()
    finally:
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    out = printed + out
    assert process.returncode == 130, err
    assert "serving model 'sd3-tiny'" in out and "the server was stopped" in err
    with pytest.raises(ConnectionError):
        _connect(port)


def _ready(client) -> bool:
    try:
        return client.is_server_ready()
    except Exception:  # not listening yet
        return False


def _connect(port: int) -> None:
    import socket

    socket.create_connection(("127.0.0.1", port), timeout=2).close()


# Adapters per request (--lora-dir): two adapters of sd3_adapters in a folder, a link that leaves it.
MAX_LORAS = 2


@pytest.fixture(scope="module")
def lora_served(tiny_artifact, sd3_adapters, tmp_path_factory):
    import shutil

    scratch = tmp_path_factory.mktemp("served-loras")
    folder = scratch / "loras"
    folder.mkdir()
    for name, path in sd3_adapters.items():
        shutil.copy(path, folder / f"{name}.safetensors")
    shutil.copy(sd3_adapters["a"], scratch / "outside.safetensors")
    (folder / "escape.safetensors").symlink_to(scratch / "outside.safetensors")
    model = write_repository(tiny_artifact, scratch / "repository", lora_dir=str(folder), max_loras=MAX_LORAS)
    with server_for(scratch / "repository") as server:
        yield server, model.name, folder


def _lora_field(loras: dict) -> str:
    return json.dumps([{"name": name, "scale": scale} for name, scale in loras.items()])


def _adapter_image(client, model, loras: dict, seed: int) -> np.ndarray:
    fields = {"seed": (np.int64, seed), **({"loras": (object, _lora_field(loras).encode())} if loras else {})}
    return client.infer(model, _inputs(tritonclient_http, **fields)).as_numpy("images")[0, 0]


def test_adapters_chosen_per_request_by_four_clients(lora_served, tiny_artifact):
    """4 concurrent clients, each alternating adapter set A, set B (both adapters) and none: every image is the
    Pipeline's with that set (no blend of sets), and A's and B's differ from none's."""
    server, model, folder = lora_served
    sets = {"a": {"a": 0.8}, "ab": {"a": 0.5, "b": 1.0}, "none": {}}
    references = {}
    for label, loras in sets.items():
        with Pipeline.load(tiny_artifact, loras={str(folder / f"{n}.safetensors"): s for n, s in loras.items()}) as pipe:
            references[label] = {seed: _reference(pipe, seed=seed) for seed in range(4)}
    assert all(not np.array_equal(references[label][0], references["none"][0]) for label in ("a", "ab"))
    jobs = [(client, list(sets)[(client + r) % 3]) for client in range(4) for r in range(3)]
    results, errors = {}, []

    def client(c):
        http = tritonclient_http.InferenceServerClient(server.http_url, network_timeout=120)
        for label in [label for owner, label in jobs if owner == c]:
            try:
                results[(c, label)] = _adapter_image(http, model, sets[label], seed=c)
            except Exception as e:  # counted: a lost or failed request fails the test below
                errors.append((c, label, e))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    wrong = [(c, label) for (c, label), image in results.items() if not np.array_equal(image, references[label][c])]
    assert len(results) == len(jobs) and not wrong, f"images that are not the Pipeline's with their set: {wrong}"
    switches = [line for line in server.log.read_text().splitlines() if "[serve] adapters" in line]
    assert switches and all("sets kept in" in line for line in switches)


BAD_ADAPTERS = {  # name: (the loras field, what the error must say)
    "a path up": ('[{"name": "../outside", "scale": 1}]', "not an adapter name"),
    "an absolute path": ('[{"name": "/etc/passwd", "scale": 1}]', "not an adapter name"),
    "a link that leaves the folder": ('[{"name": "escape", "scale": 1}]', "a link that leaves"),
    "an unknown name": ('[{"name": "nope", "scale": 1}]', "no adapter 'nope' in the server's --lora-dir; it has: a, b"),
    "a NaN scale": ('[{"name": "a", "scale": NaN}]', "scale nan of 'a' is not allowed"),
    "a huge scale": ('[{"name": "a", "scale": 1e9}]', "scale 1000000000.0 of 'a' is not allowed"),
    "too many adapters": ('[{"name": "a"}, {"name": "b"}, {"name": "escape"}]', "at most 2 at once"),
    "not JSON": ("a:0.8", "loras[0] is not JSON"),
}


@pytest.mark.parametrize("case", BAD_ADAPTERS)
def test_bad_adapter_requests_are_refused_and_the_next_succeeds(lora_served, pipe, case):
    server, model, _ = lora_served
    field, said = BAD_ADAPTERS[case]
    client = tritonclient_http.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException) as error:
        client.infer(model, _inputs(tritonclient_http, loras=(object, field.encode())))
    assert (error.value.status(), said in error.value.message()) == ("400", True), error.value.message()
    assert np.array_equal(_adapter_image(client, model, {}, seed=3), _reference(pipe, seed=3))


def test_fifty_switches_keep_the_servers_memory_bounded(lora_served):
    """Switching between two sets 50 times: the adapted weights of both stay cached (--lora-cache-mib),
    and the server's RSS does not grow from the first 25 switches to the next 25."""
    server, model, _ = lora_served
    client = tritonclient_http.InferenceServerClient(server.http_url)
    rss = []
    for i in range(50):
        _adapter_image(client, model, {"a": 0.8} if i % 2 else {"b": 1.0}, seed=i)
        if i in (24, 49):
            rss.append(server.rss_bytes())
    print(f"server RSS {rss[0] / 2**20:.1f} MiB after 25 switches, {(rss[1] - rss[0]) / 2**20:+.2f} MiB after 50")
    assert rss[1] - rss[0] < 0.05 * rss[0]


def test_flux_adapters_chosen_per_request(flux_tiny_build, flux_adapters, tmp_path):
    """flux-tiny served with --lora-dir holding a diffusers-format adapter and a kohya-format one: requests
    naming one, both and none, in turn, each get the Pipeline's image with that set, and each set changed it."""
    import shutil

    folder, artifact = tmp_path / "loras", flux_tiny_build.folder / "ort-fp32"
    folder.mkdir()
    for name in ("a", "kohya"):
        shutil.copy(flux_adapters[name], folder / f"{name}.safetensors")
    model = write_repository(artifact, tmp_path / "repository", lora_dir=str(folder), max_loras=MAX_LORAS)
    sets = {"a": {"a": 0.8}, "both": {"a": 0.5, "kohya": 1.0}, "none": {}}
    references = {}
    for label, loras in sets.items():
        with Pipeline.load(artifact, loras={str(folder / f"{n}.safetensors"): s for n, s in loras.items()}) as pipe:
            references[label] = _reference(pipe, seed=1)
    assert all(not np.array_equal(references[label], references["none"]) for label in ("a", "both"))
    with server_for(tmp_path / "repository") as server:
        client = tritonclient_http.InferenceServerClient(server.http_url, network_timeout=120)
        for label in ("a", "both", "none", "a"):
            assert np.array_equal(_adapter_image(client, model.name, sets[label], seed=1), references[label]), label
