"""Runtime backends by target name: each opens one engine file as a session whose
`run(feeds, release=False)` maps input names to numpy arrays and returns the outputs by name;
`release` frees the call's working memory when a stage is done; `close()` frees everything the
session holds (device buffers, streams, weights), after which it is not used again.

Who owns an output: the session, until its next `run`. A backend may return views of buffers it
reuses (polygraphy's TrtRunner resizes and refills one host buffer per output on every call), so a
caller that keeps an output past the session's next call copies it. The pipeline does so exactly
where it keeps one: the tiles of a tiled VAE, PLMS's past noise predictions, and what `vae_decode`
and `vae_encode` hand back (tests/test_output_ownership.py drives every path with such a backend)."""
from __future__ import annotations


def open_session(target: str, path, device: int | None = None, **options):
    """`device`: the GPU a TensorRT engine runs on (a device map's entry; default 0). `initializers`
    ({name: array}, ONNX Runtime only) replace weights of the graph: adapters (runners/lora.py)."""
    initializers = options.pop("initializers", None)
    if initializers and target != "ort":
        raise ValueError(f"{path}: adapters switch at run time on ONNX Runtime engines; this is a {target} engine "
                         f"(apply them with `python -m engines lora` to an ONNX Runtime artifact)")
    if target == "ort":
        from runners.backends.ort import OrtSession

        if device is not None:
            raise ValueError(f"{path}: a device map places TensorRT engines; this is an ONNX Runtime engine "
                             "(choose its GPU with ONNX Runtime's provider options)")
        return OrtSession(path, initializers=initializers, **options)
    if target in ("trt", "trt-rtx"):
        from runners.backends.trt import TrtSession

        return TrtSession(path, rtx=target == "trt-rtx", device=device or 0, providers=options.get("providers"))
    if target == "openvino":
        from runners.backends.openvino import OpenVinoSession

        if device is not None:
            raise ValueError(f"{path}: a device map places TensorRT engines; this is an OpenVINO model "
                             "(its device was chosen at build time: --ov-device)")
        return OpenVinoSession(path, **options)
    if target == "triton":  # a native Triton repository's engine model, called through BLS
        from runners.backends.triton_bls import BlsSession

        return BlsSession(**options["session_options"])
    raise ValueError(f"this runner has no backend for target '{target}'; it runs: ort, trt, trt-rtx, openvino "
                     "(and triton, inside a Triton repository's pipeline model)")
