"""python -m engines BUILD_DIR --target ort --precision fp32: build an artifact from BUILD_DIR/onnx.
python -m engines inspect PATH: what each graph holds in memory (see python -m engines inspect -h).
python -m engines lora ARTIFACT --lora PATH[:SCALE] --out NEW: LoRA adapters merged into a built artifact."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engines.calibration import CalibrationSettings
from engines.targets.openvino import SHAPES
from runners.static import StaticRequest


def _sizes(text: str) -> tuple[tuple[int, int], ...]:
    sizes = [size.split("x") for size in text.split(",")]
    if not all(len(sides) == 2 and all(side.isdigit() for side in sides) for sides in sizes):
        raise argparse.ArgumentTypeError(f"'{text}' is not a list of sizes like 512x512,768x1024 "
                                         "(height x width in pixels)")
    return tuple((int(h), int(w)) for h, w in sizes)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["inspect"]:
        from engines.memory.inspect import main as inspect_main

        return inspect_main(argv[1:])
    if argv[:1] == ["lora"]:
        from engines.lora import main as lora_main

        return lora_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m engines", description=__doc__)
    p.add_argument("build_dir", nargs="?", help="the export's output folder (holds onnx/)")
    p.add_argument("--target", default="ort")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--passes", help="comma-separated pass names replacing the target's own list ('' for none); "
                                     "the precision's passes still run after them")
    p.add_argument("--list-passes", action="store_true",
                   help="print every pass, each target's list and each precision's passes, then exit")
    p.add_argument("--force", action="store_true", help="rebuild even if the artifact is up to date")
    trt = p.add_argument_group("TensorRT targets (trt-rtx, trt)")
    trt.add_argument("--static", action="store_true",
                     help="build one fixed shape per input: those the runner calls for one request (the --static-* "
                          "settings), which is then the only request the artifact runs; the fastest engines")
    trt.add_argument("--static-size", type=_sizes, default=None, metavar="HxW",
                     help="the static request's image size (default: the model's default size)")
    trt.add_argument("--static-prompts", type=int, default=1, metavar="N", help="prompts per static request (default 1)")
    trt.add_argument("--static-images-per-prompt", type=int, default=1, metavar="N",
                     help="images per prompt of the static request (default 1)")
    trt.add_argument("--static-no-guidance", action="store_true",
                     help="the static request runs without classifier-free guidance (guidance_scale <= 1)")
    trt.add_argument("--compute-capability", action="append", default=[], metavar="SM89",
                     help="trt-rtx: a GPU generation to build for (repeatable; default: this machine's GPU, or every "
                          "generation TensorRT-RTX builds for on a machine without one)")
    trt.add_argument("--workspace-mib", type=int, default=None, help="the builder's workspace memory limit")
    trt.add_argument("--engine-cache", type=Path, default=None,
                     help="engines and timing cache kept across builds (default: BUILD_DIR/engine-cache)")
    trt.add_argument("--fallback", choices=["ort"], default=None,
                     help="build a submodule the target rejects for ONNX Runtime instead (the manifest says which)")
    ov = p.add_argument_group("OpenVINO target (openvino)")
    ov.add_argument("--ov-device", default=None, metavar="CPU",
                    help="also compile each model for this OpenVINO device at build time and ship the compiled "
                         "blob, so that the runner's first call does not compile (default: IR only)")
    ov.add_argument("--ov-shapes", choices=SHAPES, default=None,
                    help="how the runner shapes the denoiser: per-size (the default) compiles it for each request's "
                         "shapes at their first call and keeps it; dynamic compiles one model for every shape")
    ov.add_argument("--ov-sizes", type=_sizes, default=(), metavar="512x512[,HxW...]",
                    help="also compile the denoiser static for these image sizes (height x width) at build time, "
                         "for --ov-device (alone, --ov-device does it for the model's default size)")
    mem = p.add_argument_group("memory (ort): python -m engines inspect shows what a graph holds")
    mem.add_argument("--memory", action="store_true",
                     help="add the memory passes (fusion, schedule, recompute) and the runtime settings that keep "
                          "them; writes <target>-<precision>-memory")
    mem.add_argument("--memory-budget", default=None, metavar="SIZE",
                     help="recompute until the planned peak at the default image size is at most SIZE (e.g. 2GiB); "
                          "the manifest says if it was unreachable")
    calib = p.add_argument_group("calibration (fp16 and fp8 measure the fp32 pipeline's activations first)")
    calib.add_argument("--calibration-prompts", type=int, default=CalibrationSettings.prompts,
                       help="how many of the fixed calibration prompts to run (default: %(default)s)")
    calib.add_argument("--calibration-steps", type=int, default=CalibrationSettings.steps,
                       help="denoising steps per prompt, all recorded (default: %(default)s)")
    calib.add_argument("--calibration-size", type=int, default=None,
                       help="image side in pixels (default: the model's default size)")
    args = p.parse_args(argv)

    from engines.passes import PassFailed, UnknownPass, describe_passes
    from engines.precisions import describe_precisions
    from engines.targets import BuildOptions, EngineBuildError, SubmoduleBuildFailed, TargetError, describe_targets

    if args.list_passes:
        print(describe_passes() + "\n\n" + describe_targets() + "\n" + describe_precisions())
        return 0
    if args.build_dir is None:
        p.error("BUILD_DIR is required (or --list-passes)")

    from engines.api import build_artifact
    from engines.memory.sizes import parse_size
    from runners.cli import run_cli
    from runners.manifest import ManifestError

    passes = None if args.passes is None else args.passes.split(",")
    static_settings = (args.static_size, args.static_prompts != 1, args.static_images_per_prompt != 1,
                       args.static_no_guidance)
    if any(static_settings) and not args.static:
        p.error("--static-size, --static-prompts, --static-images-per-prompt and --static-no-guidance describe "
                "the request of a --static build: add --static")
    if args.static_size and len(args.static_size) != 1:
        p.error("--static-size takes one size (HxW): a static build runs one request")
    static = args.static and StaticRequest(*(args.static_size or [(None, None)])[0], args.static_prompts,
                                           args.static_images_per_prompt, not args.static_no_guidance)
    return run_cli(lambda: build_artifact(
        args.build_dir, args.target, args.precision, force=args.force, passes=passes,
        calibration=CalibrationSettings(args.calibration_prompts, args.calibration_steps, args.calibration_size),
        options=BuildOptions(static or None, tuple(args.compute_capability), args.workspace_mib, args.engine_cache,
                             args.ov_device, args.ov_shapes, args.ov_sizes),
        fallback=args.fallback, memory=args.memory,
        memory_budget=parse_size(args.memory_budget) if args.memory_budget is not None else None),
        (TargetError, ManifestError, PassFailed, UnknownPass, SubmoduleBuildFailed, EngineBuildError, ValueError),
        "no artifact was written")


if __name__ == "__main__":
    sys.exit(main())
