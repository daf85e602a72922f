"""The OpenAI-compatible images API (runners/serving/openai_api.py) on sd3-tiny, through the real
`openai` client on 127.0.0.1: its images are the Pipeline's for the same options, n images per
prompt, image to image and inpainting through /v1/images/edits, and a bad field is HTTP 400 naming it
while the next request succeeds. The server is uvicorn in this process, stopped by the fixture."""
from __future__ import annotations

import base64
import io
import socket
import threading
import time
from contextlib import contextmanager

import numpy as np
import openai
import pytest
from PIL import Image

from runners import Pipeline
from runners.serving.openai_api import create_app

SIZE, STEPS = 64, 2


@contextmanager
def openai_client(pipe, model_name: str):
    """An `openai` client of `pipe` served as `model_name` by uvicorn in this process on a free loopback port,
    stopped on leaving."""
    import uvicorn

    with socket.socket() as s:  # a free port on loopback
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(pipe, model_name), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def api(tiny_artifact):
    with Pipeline.load(tiny_artifact) as pipe, openai_client(pipe, "sd3-tiny") as client:
        yield client, pipe


def pixels(item) -> np.ndarray:
    """The image of a b64_json response item."""
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(item.b64_json))))


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def test_generations_are_the_pipelines_images(api):
    client, pipe = api
    result = client.images.generate(model="sd3-tiny", prompt="a photo of a cat", n=2, size=f"{SIZE}x{SIZE}",
                                    response_format="b64_json",
                                    extra_body={"seed": 3, "num_inference_steps": STEPS, "guidance_scale": 5.0,
                                                "negative_prompt": "blurry"})
    expected = pipe("a photo of a cat", num_images_per_prompt=2, height=SIZE, width=SIZE, seed=3,
                    num_inference_steps=STEPS, guidance_scale=5.0, negative_prompt="blurry")
    assert len(result.data) == 2
    for item, image in zip(result.data, expected):
        assert np.array_equal(pixels(item), np.asarray(image))
    other = client.images.generate(prompt="a photo of a cat", size=f"{SIZE}x{SIZE}", response_format="b64_json",
                                   extra_body={"seed": 4, "num_inference_steps": STEPS})
    assert not np.array_equal(pixels(other.data[0]), pixels(result.data[0]))  # the seed reached the run


def test_edits_run_image_to_image_and_inpainting(api):
    client, pipe = api
    start = Image.fromarray(np.random.default_rng(0).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))
    mask = Image.fromarray(np.where(np.arange(SIZE)[:, None] < SIZE // 2, 255, 0).repeat(SIZE, 1).astype(np.uint8))
    options = dict(seed=1, num_inference_steps=4, strength=0.5)
    edited = client.images.edit(image=("in.png", png(start), "image/png"), prompt="a cat", size=f"{SIZE}x{SIZE}",
                                response_format="b64_json", extra_body=options)
    expected = pipe("a cat", image=start, height=SIZE, width=SIZE, **options)[0]
    assert np.array_equal(pixels(edited.data[0]), np.asarray(expected))
    painted = client.images.edit(image=("in.png", png(start), "image/png"), mask=("m.png", png(mask), "image/png"),
                                 prompt="a cat", size=f"{SIZE}x{SIZE}", response_format="b64_json", extra_body=options)
    expected = pipe("a cat", image=start, mask_image=mask, height=SIZE, width=SIZE, **options)[0]
    assert np.array_equal(pixels(painted.data[0]), np.asarray(expected))
    assert not np.array_equal(pixels(painted.data[0]), pixels(edited.data[0]))


BAD = {  # name: (the request's fields, the field the error names, what it says)
    "an unknown field": ({"num_inference_step": 2}, "num_inference_step",
                         "num_inference_step is not a field of this sd3 artifact's requests"),
    "a seed out of range": ({"seed": -1}, "seed", "seed=-1 is not allowed: use an integer from 0 to 2**63 - 1"),
    "a size that is no size": ({"size": "large"}, "size", "size='large' is not allowed: use WIDTHxHEIGHT"),
    "a size off the artifact's range": ({"size": "100x64"}, None, "width=100 is not allowed: use a multiple of"),
    "url responses": ({"response_format": "url"}, "response_format", "response_format='url' is not served"),
    "another model": ({"model": "dall-e-3"}, "model", "model 'dall-e-3' is not served here"),
    "a zero n": ({"n": 0}, "n", "num_images_per_prompt=0 is not allowed: use an integer >= 1"),
    "a wrong kind": ({"guidance_scale": "high"}, "guidance_scale", "guidance_scale='high' is not allowed"),
    "adapters that are not JSON": ({"loras": "style:0.8"}, "loras", "loras[0] is not JSON"),
    "a control image without ControlNets": ({"control_image": ["aGVsbG8="]}, "control_image",
                                            "control_image is not a field of this sd3 artifact's requests"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_field_is_400_naming_it_and_the_next_request_succeeds(api, case):
    client, _ = api
    fields, param, said = BAD[case]
    openai_fields = {k: fields.pop(k) for k in ("size", "response_format", "model", "n") if k in fields}
    request = {"prompt": "a cat", "size": f"{SIZE}x{SIZE}", "response_format": "b64_json", **openai_fields}
    with pytest.raises(openai.BadRequestError) as error:
        client.images.generate(**request, extra_body={"num_inference_steps": 1, **fields})
    body = error.value.body
    assert error.value.status_code == 400 and said in body["message"], body
    assert body["param"] == param and body["type"] == "invalid_request_error"
    ok = client.images.generate(prompt="a cat", size=f"{SIZE}x{SIZE}", response_format="b64_json",
                                extra_body={"num_inference_steps": 1})
    assert pixels(ok.data[0]).shape == (SIZE, SIZE, 3)
