"""An OpenAI-compatible images API over an artifact, as OpenVINO Model Server serves image generation:
`POST /v1/images/generations` (JSON) for text to image, `POST /v1/images/edits` (multipart, with an
`image` file and optionally a `mask` file) for image to image and inpainting. `python -m runners
openai ARTIFACT` serves it on 127.0.0.1 (runners/serving/cli.py).

OpenAI's fields map onto the call: `prompt`, `n` (num_images_per_prompt), `size` ("WIDTHxHEIGHT"),
`response_format` (b64_json only: the images go back in the response, nothing is stored), `model` (the
served one's name, or left out). Every other field is one of the artifact's declared request options
(runners/options.py: `seed`, `num_inference_steps`, `guidance_scale`, `negative_prompt`, `strength`, ...),
given as extra body fields, plus the servers' `cache` and `loras` (runners/serving/requests.py). An artifact
with ControlNets takes `control_image` (JSON: base64 image files, one per ControlNet; multipart: one file
or base64 field each) and their settings (`controlnet_conditioning_scale`: a number, or one per
ControlNet). A bad field is HTTP 400 with OpenAI's error body, naming the field and what is allowed.

One request runs at a time (the engines use every core); the others wait in FastAPI's thread pool.
Needs the serve extra (FastAPI, uvicorn); the rest of the runner imports without it."""
from __future__ import annotations

import base64
import binascii
import io
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from runners.options import check_call
from runners.serving import adapters as adapter_fields
from runners.serving.requests import per_controlnet, served

# OpenAI's own fields, read here; the rest of a request's fields are the artifact's options.
OPENAI_FIELDS = ("prompt", "n", "size", "response_format", "model", "user")
_SERVER_FIELDS = ("cache", "loras")


class BadField(ValueError):
    """A request field that cannot be served: answered with HTTP 400 naming it."""

    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field = field


def create_app(pipe, model_name: str, adapter_sets=None):
    """The FastAPI app serving `pipe` (a loaded Pipeline) as `model_name`; `adapter_sets` (an AdapterSets:
    runners/serving/adapters.py) lets a request name LoRA adapters in `loras`."""
    if pipe.layout.video:
        raise ValueError(f"{pipe.folder} makes videos, which OpenAI's images API cannot return: serve it with Triton "
                         "(`python -m runners serve ARTIFACT`: its frames, and mp4 files on request)")
    app = FastAPI(title="diffusion-aot images API", docs_url=None, redoc_url=None)
    lock = threading.Lock()
    options = {o.name: o for o in served(type(pipe), pipe.manifest)}

    @app.exception_handler(BadField)
    async def bad_field(request, error: BadField):
        return JSONResponse(status_code=400, content={"error": {
            "message": str(error), "type": "invalid_request_error", "param": error.field, "code": None}})

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "diffusion-aot"}]}

    @app.post("/v1/images/generations")
    async def generations(request: Request):
        try:
            body = await request.json()
        except ValueError:
            raise BadField(None, "the body is not JSON: send the fields as a JSON object") from None
        if not isinstance(body, dict):
            raise BadField(None, "the body must be a JSON object of fields")
        images = [name for name, o in options.items() if o.kind in ("image", "mask") and not o.repeat and name in body]
        if images:
            raise BadField(images[0], f"{images[0]}: an image goes to /v1/images/edits as a multipart file")
        for name in [name for name, o in options.items() if o.kind == "image" and o.repeat and name in body]:
            given = body[name] if isinstance(body[name], list) else [body[name]]
            body[name] = [_image(name, _decoded(name, value), "RGB") for value in given]
        return run(body)

    @app.post("/v1/images/edits")
    async def edits(request: Request):
        form = await request.form()
        fields, files, repeated = {}, {}, {}
        for name, value in form.multi_items():
            name = name.removesuffix("[]")  # the openai client sends a list as repeated `name[]` fields
            option = options.get(name)
            if option is not None and option.repeat:  # a per-ControlNet option: one field per ControlNet
                if option.kind == "image":  # a file, or its base64 text
                    value = _image(name, await value.read() if hasattr(value, "read") else _decoded(name, value),
                                   "RGB")
                elif hasattr(value, "read"):
                    raise BadField(name, f"{name}: send its values as fields, not files")
                else:
                    value = _typed(options, name, value)
                repeated.setdefault(name, []).append(value)
            elif hasattr(value, "read"):
                files[name] = await value.read()
            else:
                fields[name] = _typed(options, name, value)
        fields.update({name: per_controlnet(options[name], values) for name, values in repeated.items()})
        for name, field in (("image", "image"), ("mask", "mask_image")):
            if name in files:
                fields[field] = _image(name, files.pop(name), "RGB" if name == "image" else "L")
        if "image" not in fields:
            raise BadField("image", "image is missing: an edit needs the image file to start from")
        if files:
            raise BadField(next(iter(files)), f"{next(iter(files))}: the files served are image and mask")
        return run(fields)

    def run(fields: dict) -> dict:
        call, server = _call(pipe, model_name, options, fields)
        with lock:
            try:
                if adapter_sets is not None:
                    adapter_sets.activate(pipe, adapter_sets.paths(server.get("loras", ())))
                elif server.get("loras"):
                    raise BadField("loras", "loras: this server serves no adapters (started without --lora-dir)")
                images = pipe(**call, cache=server.get("cache"), output_type="pil")
            except BadField:
                raise
            except ValueError as e:
                raise BadField(None, str(e)) from None
        return {"created": int(time.time()), "data": [{"b64_json": _png(image)} for image in images]}

    return app


def _call(pipe, model_name: str, options: dict, fields: dict) -> tuple[dict, dict]:
    """(the Pipeline call's keywords, the server's own fields) of a request's fields, checked."""
    if not isinstance(fields.get("prompt"), str) or not fields["prompt"]:
        raise BadField("prompt", "prompt is missing: every request needs a prompt (a non-empty string)")
    model = fields.get("model")
    if model not in (None, model_name):
        raise BadField("model", f"model {model!r} is not served here; this server serves {model_name!r}")
    if fields.get("response_format", "b64_json") != "b64_json":
        raise BadField("response_format", f"response_format={fields['response_format']!r} is not served: use "
                       "b64_json (the images come back in the response; none is stored)")
    call = {"prompt": fields["prompt"]}
    if fields.get("n") is not None:
        call["num_images_per_prompt"] = fields["n"]
    if fields.get("size") not in (None, "auto"):
        call["width"], call["height"] = _size(fields["size"])
    server = {}
    for name, value in fields.items():
        if name in OPENAI_FIELDS:
            continue
        if name in _SERVER_FIELDS:
            try:
                server[name] = adapter_fields.parse(value, 0) if name == "loras" else value
            except ValueError as e:
                raise BadField(name, str(e)) from None
            continue
        if name not in options:
            known = sorted(set(options) - {"prompt", "num_images_per_prompt", "width", "height"})
            raise BadField(name, f"{name} is not a field of this {pipe.family} artifact's requests; it takes the "
                           f"OpenAI fields {', '.join(OPENAI_FIELDS[:4])} and: {', '.join(known + list(_SERVER_FIELDS))}")
        call[name] = value
    try:
        check_call(pipe, call)
    except ValueError as e:
        name = str(e).split("=", 1)[0]
        field = {"num_images_per_prompt": "n", "width": "size", "height": "size"}.get(name, name)
        raise BadField(field if field in fields else None, str(e)) from None
    return call, server


def _size(text) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in str(text).lower().split("x"))
    except ValueError:
        raise BadField("size", f"size={text!r} is not allowed: use WIDTHxHEIGHT in pixels, such as 512x512, "
                       "or auto") from None
    return width, height


def _typed(options: dict, name: str, text: str):
    """A multipart field's text as the value of its option's kind."""
    option = options.get(name)
    kind = option.kind if option is not None else "int" if name == "n" else "text"
    try:
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        if kind == "bool":
            return {"true": True, "false": False}[text.strip().lower()]
    except (ValueError, KeyError):
        raise BadField(name, f"{name}={text!r} is not allowed: use {'true or false' if kind == 'bool' else 'a number'}") \
            from None
    return text


def _decoded(field: str, value) -> bytes:
    """A JSON field's image: the base64 text of its file."""
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise BadField(field, f"{field}: send each image as the base64 text of a PNG, JPEG or WebP file (a string, "
                       "or a list of them: one per ControlNet)") from None


def _image(field: str, data: bytes, mode: str):
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert(mode)
    except (UnidentifiedImageError, OSError):
        raise BadField(field, f"{field} is not an image file Pillow can read: send a PNG, JPEG or WebP") from None


def _png(image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode("ascii")


def serve(pipe, model_name: str, host: str = "127.0.0.1", port: int = 8000, adapter_sets=None, log_level="warning"):
    """Serve until stopped (Ctrl-C, SIGTERM): uvicorn on `host`:`port`, loopback by default."""
    import uvicorn

    uvicorn.run(create_app(pipe, model_name, adapter_sets), host=host, port=port, log_level=log_level)
