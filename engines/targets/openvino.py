"""OpenVINO target: the prepared ONNX graph becomes OpenVINO IR (`.xml` + `.bin`), and optionally the
model compiled for one device (`BuildOptions.device`, `--ov-device CPU`), exported beside it so that
the runner imports it instead of compiling.

OpenVINO takes its precision as a hint (INFERENCE_PRECISION_HINT), not from graph types: the
precision recipe gives the hint (`engines.precisions`), the manifest records it per submodule as the
runtime's config, and the runner passes it to `compile_model`. fp32 keeps the IR's weights in fp32;
bf16 and fp16 store them as fp16 (`save_model(compress_to_fp16=True)`), which the plugin turns into
its inference precision when it compiles. int8 is NNCF's quantization of the IR, calibrated on
the pipeline's recordings (`engines.targets.openvino_int8`), with what stays in float run in bf16.
The IR has the export's dynamic dims.
"""
from __future__ import annotations

import tempfile
from importlib import metadata
from pathlib import Path

from engines.targets import BuildInput, BuildOptions, SubmoduleBuildFailed, Target, TargetError
from engines.targets import openvino_int8

# What OpenVINO 2026.4's ONNX reader accepts, measured on every sd3-tiny submodule (convert_model,
# then compile_model on the CPU, then outputs against ONNX Runtime at both export shapes): all of
# fold_constants, infer_shapes, remove_dead_nodes, fuse_qkv and fuse_attention. It reads ONNX
# Runtime's com.microsoft.MultiHeadAttention as its own ScaledDotProductAttention, and the CPU
# plugin runs attention as one fused subgraph with or without the fusion (same outputs within 1e-6
# of their scale); with it the graph reaches the plugin with fewer shape ops. The memory passes
# (schedule_memory, remat) keep an order and recomputes that only ONNX Runtime's session settings
# hold: OpenVINO plans its own memory.
PASSES = ("fold_constants", "infer_shapes", "remove_dead_nodes", "fuse_qkv", "fuse_attention")
HINT = "INFERENCE_PRECISION_HINT"


def compiled_name(name: str, device: str) -> str:
    return f"{name}.{device.lower().replace('.', '-')}.blob"


def check_device(core, device: str) -> None:
    """A device that is not present is the user's error: one line naming the ones that are."""
    if device not in core.available_devices:
        raise TargetError(f"OpenVINO device '{device}' is not present on this machine; it has: "
                          f"{', '.join(core.available_devices)}")


def build_submodule(sub: BuildInput, out_dir: Path, options: BuildOptions) -> tuple[list[str], dict]:
    import onnx_ir as ir
    import openvino as ov

    if options.static or options.compute_capabilities or options.workspace_mib:
        raise TargetError("--static, --compute-capability and --workspace-mib are TensorRT settings; "
                          "the openvino target takes --ov-device")
    config = {HINT: sub.precision.runtime[HINT]}
    core = ov.Core()
    if options.device:
        check_device(core, options.device)
    with tempfile.TemporaryDirectory(prefix="onnx-for-openvino-", dir=out_dir) as tmp:
        onnx_path = Path(tmp) / f"{sub.name}.onnx"
        ir.save(sub.model, onnx_path, external_data=f"{sub.name}.onnx.data")  # any size: weights beside it
        try:
            model = ov.convert_model(onnx_path)
        except Exception as e:  # the ONNX frontend raises OpConversionFailure and plain RuntimeErrors
            raise SubmoduleBuildFailed(f"OpenVINO could not read {sub.name}: {type(e).__name__}: "
                                       f"{str(e).strip().splitlines()[-1]}") from e
        quantized = {}
        if sub.precision.quantize:
            model, counts, details = openvino_int8.quantize(model, sub.model, sub.entry, sub.calibration)
            quantized = {"quantization": {"tool": f"nncf {metadata.version('nncf')}", "counts": counts, **details}}
        files = [f"{sub.name}.xml", f"{sub.name}.bin"]
        # Weights stored as fp16 only where the precision computes below fp32.
        ov.save_model(model, out_dir / files[0], compress_to_fp16=config[HINT] != "f32")
    del model
    session_options = {"device": options.device or "CPU"}
    if options.device:
        # The runner imports this blob: the plugin's own compiled form for this device and release.
        compiled = core.compile_model(out_dir / files[0], options.device, config)
        blob = compiled_name(sub.name, options.device)
        exported = compiled.export_model()  # bytes, or an io.BytesIO in recent releases
        (out_dir / blob).write_bytes(exported.getvalue() if hasattr(exported, "getvalue") else exported)
        del compiled
        files.append(blob)
        session_options["compiled_model"] = blob
    else:  # no blob: prove the IR compiles here (CPU), as the ORT target opens a session
        core.compile_model(out_dir / files[0], "CPU", config)
    return files, {"session_config": config, "session_options": session_options,
                   "engine": {"openvino": ov.get_version(),
                              "weights": "f32" if config[HINT] == "f32" else "i8 and f16" if quantized else "f16",
                              **({"compiled_for": options.device} if options.device else {})},
            **quantized}


TARGETS = [Target(
    name="openvino",
    backend_module="openvino",
    backend_distributions=("openvino",),
    install_hint="pip install 'diffusion-aot[openvino]'",
    # fp16 is for GPU and NPU devices (the CPU plugin has no f16 hint on most CPUs).
    precisions=("fp32", "bf16", "fp16", "int8"),
    passes=PASSES,
    build_submodule=build_submodule,
    build_options=True,
)]
