"""OpenVINO target: the prepared ONNX graph becomes OpenVINO IR (`.xml` + `.bin`), and optionally the
model compiled for one device (`OpenVinoOptions.device`, `--ov-device CPU`), exported beside it so that
the runner imports it instead of compiling.

Shapes: the IR keeps the export's dynamic dims. The manifest entry of each submodule the image size
shapes (the denoiser, its ControlNets, the autoencoders) says how the runner shapes it (`--ov-shapes`):
"per-size" reshapes it to each request's shapes at its first call and caches the compiled model per
size; "dynamic" compiles it once for every shape. `--ov-sizes 512x512` also compiles them static for
listed sizes at build time for `--ov-device`, which alone compiles per-size ones at the export's opt
size (the model's default). The text encoders, whose shapes follow only the prompt count, stay dynamic.

OpenVINO takes its precision as a hint (INFERENCE_PRECISION_HINT), not from graph types: this target
takes every precision its own way (`PRECISIONS`: no precision passes run), the manifest records it per submodule as the
runtime's config, and the runner passes it to `compile_model`. fp32 keeps the IR's weights in fp32;
bf16 and fp16 store them as fp16 (`save_model(compress_to_fp16=True)`), which the plugin turns into
its inference precision when it compiles. int8 is NNCF's quantization of the IR, calibrated on
the pipeline's recordings (`engines.targets._openvino_int8`), with what stays in float run in bf16.
"""
from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import ClassVar

from engines.precisions import TargetRecipe
from engines.targets import (RESOLVED, BuildInput, SubmoduleBuildFailed, Target, TargetError, TargetOptions,
                             folder_suffix, sizes_argument)
from engines.targets import _openvino_int8, _openvino_lora, _openvino_weights
from runners.backends import cpu_threads
from runners.backends.openvino import openvino_core
from runners.static import StaticRequest

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


# A model compiled for the request's shapes runs faster: the denoiser at every step (BENCHMARKS.md's CPU
# runtimes table, whose shape rows measure the ways), and the VAE, whose one call in a run comes after the
# runner released its working memory, where a dynamic model's call is slower than its steady state. Compiling
# one size costs a fraction of a second. The text encoders stay dynamic: their shapes follow only the prompt
# count, and they hold most of the model's weights, of which each compiled size may keep its own copy.
IMAGE_SHAPES = "per-size"
SHAPES = ("dynamic", "per-size")


def without_usage_telemetry() -> None:
    """A build sends no usage telemetry. OpenVINO's converter (`convert_model`) and NNCF report each call to
    Google Analytics through openvino_telemetry, on by default for both, from threads of their own. Its one
    instance per process decides when it is made, and both have it decline in CI jobs: that check answers yes
    here, and an instance made before (NNCF makes one when imported) is told no. Besides the traffic, the
    threads took the CPU: wan-tiny's openvino-bf16 build on one core took 12.3 s with them and 4.5 s without
    (each `compile_model` after a `convert_model` ran 4 times slower)."""
    try:
        from openvino_telemetry import Telemetry
        from openvino_telemetry.utils.opt_in_checker import OptInChecker
    except ImportError:  # openvino's own stub then, which sends nothing
        return
    OptInChecker._run_in_ci = staticmethod(lambda: True)
    try:
        Telemetry().consent = False
    except RuntimeError:  # no instance yet (made without its application's name)
        pass


def _hint(hint: str, quantize: bool = False) -> TargetRecipe:
    return TargetRecipe({HINT: hint}, quantize)


# Every precision it takes, its own way: a runtime hint, and for int8 NNCF's quantization of the IR
# (what NNCF leaves in float runs in bf16, the CPU plugin's own choice where it has bf16). fp16 is for
# GPU and NPU devices (the CPU plugin has no f16 hint on most CPUs).
PRECISIONS = {"fp32": _hint("f32"), "bf16": _hint("bf16"), "fp16": _hint("f16"), "int8": _hint("bf16", quantize=True)}


@dataclass(frozen=True)
class OpenVinoOptions(TargetOptions):
    """What the OpenVINO target takes: a device to compile for at build time, and how the submodules the image size
    shapes are shaped."""

    title: ClassVar[str] = "OpenVINO"

    device: str | None = None  # the device to compile for at build time ("CPU"); None: IR only
    # The submodules the image size shapes: "dynamic" (one model for every shape) or "per-size" (reshaped to
    # each request's shapes at its first call, cached per size); None: the target's default (IMAGE_SHAPES).
    shapes: str | None = None
    sizes: tuple[tuple[int, int], ...] = ()  # (height, width)s those are compiled static for
    weights: str | None = None  # "int8", "int4": the float precisions' linear weights so (_openvino_weights)
    # The export's pipeline constants (filled in by `resolved`): how a size sets every dim the denoiser's
    # graphs take (image tokens, a U-Net's ControlNet residual sides), as the runner will call them.
    pipeline: dict | None = dataclasses.field(default=None, compare=False, repr=False, metadata=RESOLVED)

    @classmethod
    def add_arguments(cls, group) -> None:
        group.add_argument("--ov-device", default=None, metavar="CPU",
                           help="also compile each model for this OpenVINO device at build time and ship the "
                                "compiled blob, so that the runner's first call does not compile (default: IR only)")
        group.add_argument("--ov-shapes", choices=SHAPES, default=None,
                           help="how the runner shapes the submodules the image size shapes (the denoiser, its "
                                "ControlNets, the VAE): per-size (the default) compiles each for a request's shapes "
                                "at their first call and keeps it; dynamic compiles one model for every shape")
        group.add_argument("--ov-sizes", type=sizes_argument, default=(), metavar="512x512[,HxW...]",
                           help="also compile the submodules the image size shapes static for these image sizes "
                                "(height x width) at build time, for --ov-device (alone, --ov-device does it for the "
                                "model's default size)")
        group.add_argument("--ov-weights", choices=_openvino_weights.WEIGHTS, default=None,
                           help="store the linear layers' weights in int8 (one scale per output channel) or int4 "
                                "(one per channel and 128 inputs), computed in the precision's float type: a half or "
                                "a quarter of the IR of fp16/bf16, quantized a weight at a time (for models too "
                                "large for NNCF's in memory; default: the precision's own)")

    @classmethod
    def from_args(cls, args) -> OpenVinoOptions:
        return cls(args.ov_device, args.ov_shapes, args.ov_sizes, args.ov_weights)

    def settings(self) -> dict:
        settings = {"device": self.device, "ov_shapes": self.shapes, "ov_sizes": [list(s) for s in self.sizes],
                    "ov_weights": self.weights}
        return {k: v for k, v in settings.items() if v}

    def variant(self) -> str:
        """Every option that changes the manifest names the folder, so that builds with other options sit
        beside the default one instead of replacing it: `openvino-int8-dynamic`, `openvino-bf16-cpu-512x512`."""
        return folder_suffix(self.weights and f"{self.weights}-weights", self.shapes,
                             self.device and _device_name(self.device), *(f"{h}x{w}" for h, w in self.sizes))

    def resolved(self, build_dir: Path, source: dict, precision: str) -> OpenVinoOptions:
        if self.sizes and not self.device:
            raise TargetError("--ov-sizes compiles the denoiser for a device at build time: add --ov-device CPU")
        if self.shapes not in (None, *SHAPES):
            raise TargetError(f"--ov-shapes {self.shapes}: the openvino target takes {' or '.join(SHAPES)}")
        if self.weights not in (None, *_openvino_weights.WEIGHTS):
            raise TargetError(f"--ov-weights {self.weights}: the openvino target takes "
                              f"{' or '.join(_openvino_weights.WEIGHTS)}")
        if self.weights and PRECISIONS[precision].quantize:
            raise TargetError(f"--ov-weights {self.weights} is for the float precisions: --precision {precision} "
                              f"quantizes the weights itself (NNCF)")
        # The default named is the default: one folder and one cache key.
        shapes = None if self.shapes == IMAGE_SHAPES else self.shapes
        return dataclasses.replace(self, shapes=shapes, pipeline=source["pipeline"])


def _device_name(device: str) -> str:
    return device.lower().replace(".", "-")  # "GPU.1" -> "gpu-1"


def compiled_name(name: str, device: str, size: tuple[int, int] | None = None) -> str:
    at = f".{size[0]}x{size[1]}" if size else ""
    return f"{name}{at}.{_device_name(device)}.blob"


def check_device(core, device: str) -> None:
    """A device that is not present is the user's error: one line naming the ones that are."""
    if device not in core.available_devices:
        raise TargetError(f"OpenVINO device '{device}' is not present on this machine; it has: "
                          f"{', '.join(core.available_devices)}")


def _size_dims(sub: BuildInput, size: tuple[int, int], pipeline: dict) -> dict[str, int]:
    """The dims of a `height x width` request of one prompt and image with guidance (the batch the runner
    calls the submodule at: 2 for the denoiser, 1 for the VAE), checked against the export's ranges."""
    c = sub.constants
    step = c["vae_scale_factor"] * c.get("latent_multiple", 1)
    dims = StaticRequest(*size).dims(sub.name, pipeline)
    lo, hi = (sub.entry["dims"]["latent_height"][i] * c["vae_scale_factor"] for i in (0, 2))
    if any(side % step or not lo <= side <= hi for side in size):
        raise TargetError(f"--ov-sizes {size[0]}x{size[1]}: this export takes sides from {lo} to {hi} "
                          f"in steps of {step}")
    return dims


def _shaped_by_image(sub: BuildInput) -> bool:
    """Whether the request's image size sets some of the submodule's input dims (latent or image sides,
    image tokens): every submodule but the text encoders."""
    return any(isinstance(d, str) and d not in sub.constants and d.startswith(("latent_", "image_"))
               for t in sub.entry["inputs"] for d in t["shape"])


def _opt_size(sub: BuildInput) -> tuple[int, int]:
    return tuple(sub.entry["dims"][d][1] * sub.constants["vae_scale_factor"] for d in ("latent_height", "latent_width"))


def _export_compiled(core, model, device: str, config: dict, path: Path) -> None:
    exported = core.compile_model(model, device, config).export_model()  # bytes, or an io.BytesIO in recent releases
    path.write_bytes(exported.getvalue() if hasattr(exported, "getvalue") else exported)


def build_submodule(sub: BuildInput, out_dir: Path, options: OpenVinoOptions) -> tuple[list[str], dict]:
    import onnx_ir as ir
    import openvino as ov

    shapes, sizes = "dynamic", ()
    if _shaped_by_image(sub):
        shapes = options.shapes or IMAGE_SHAPES
        # Compiled for a device, a per-size submodule ships its default size's static model.
        sizes = options.sizes or ((_opt_size(sub),) if options.device and shapes == "per-size" else ())
    config = {HINT: sub.precision.runtime[HINT]}
    without_usage_telemetry()  # before the converter's and NNCF's first report in this process
    core = openvino_core(cpu_threads(None))  # before NNCF's first compile in this process
    if options.device:
        check_device(core, options.device)
    with tempfile.TemporaryDirectory(prefix="onnx-for-openvino-", dir=out_dir) as tmp:
        onnx_path = Path(tmp) / f"{sub.name}.onnx"
        compressed = _openvino_weights.compress_weights(sub.model, options.weights) if options.weights else {}
        ir.save(sub.model, onnx_path, external_data=f"{sub.name}.onnx.data")  # any size: weights beside it
        sub.source_read()  # the converter reads this copy: the export's may go before the IR is written
        try:
            model = ov.convert_model(onnx_path)
        except Exception as e:  # the ONNX frontend raises OpConversionFailure and plain RuntimeErrors
            raise SubmoduleBuildFailed(f"OpenVINO could not read {sub.name}: {type(e).__name__}: "
                                       f"{str(e).strip().splitlines()[-1]}") from e
        quantized = {}
        if sub.precision.quantize:
            model, counts, details = _openvino_int8.quantize(model, sub.model, sub.entry, sub.calibration)
            quantized = {"quantization": {"tool": f"nncf {metadata.version('nncf')}", "counts": counts, **details}}
        lora_layers = _openvino_lora.record_layers(sub.model, model, sub.weights) if sub.weights else 0
        files = [f"{sub.name}.xml", f"{sub.name}.bin"]
        # Weights stored as fp16 only where the precision computes below fp32.
        ov.save_model(model, out_dir / files[0], compress_to_fp16=config[HINT] != "f32")
    del model
    session_options = {"device": options.device or "CPU", "shapes": shapes}
    stored = ", ".join(f"i{kind[3:]}" for kind, n in compressed.items() if n) or ("i8" if quantized else None)
    float_type = "f32" if config[HINT] == "f32" else "f16"
    if options.device and shapes == "dynamic":
        # The runner imports this blob: the plugin's own compiled form for this device and release.
        files.append(compiled_name(sub.name, options.device))
        _export_compiled(core, out_dir / files[0], options.device, config, out_dir / files[-1])
        session_options["compiled_model"] = files[-1]
    elif not sizes:  # no blob: prove the IR compiles here (CPU), as the ORT target opens a session
        core.compile_model(out_dir / files[0], "CPU", config)
    static = []
    for size in sizes:  # the submodule reshaped to each listed request and compiled: static blobs
        model = core.read_model(out_dir / files[0])
        at = sub.shapes_at(_size_dims(sub, size, options.pipeline))
        model.reshape({name: ov.PartialShape(shape) for name, shape in at.items()})
        files.append(compiled_name(sub.name, options.device, size))
        _export_compiled(core, model, options.device, config, out_dir / files[-1])
        static.append({"size": f"{size[0]}x{size[1]}", "shapes": at, "file": files[-1]})
    if static:
        session_options["static_models"] = static
    return files, {"session_config": config, "session_options": session_options,
                   "engine": {"openvino": ov.get_version(),
                              "weights": f"{stored} and {float_type}" if stored else float_type,
                              **{f"{kind}_weights": n for kind, n in compressed.items()},
                              "lora_layers": lora_layers,
                              **({"compiled_for": options.device} if options.device else {})},
            **quantized}


TARGETS = [Target(
    name="openvino",
    backend="openvino",
    backend_module="openvino",
    backend_distributions=("openvino",),
    install_hint="pip install 'diffusion-aot[openvino]'",
    precisions=tuple(PRECISIONS),
    own_precisions=PRECISIONS,
    passes=PASSES,
    build_submodule=build_submodule,
    options=OpenVinoOptions,
)]
