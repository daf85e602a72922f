"""python -m engines BUILD_DIR --target ort --precision fp32: build an artifact from BUILD_DIR/onnx
(--dry-run: print what would be built, and build nothing; --print-artifact: only its folder).
python -m engines inspect PATH: what each graph holds in memory (see python -m engines inspect -h).
python -m engines lora ARTIFACT --lora PATH[:SCALE] --out NEW: LoRA adapters merged into a built artifact.

Each target adds its own flags (engines/targets: its options' `add_arguments`); a flag of another
target's is refused, naming the targets it belongs to."""
from __future__ import annotations

import argparse
import sys

from engines.calibration import LARGEST_DEFAULT_SIZE, CalibrationSettings


def _parser() -> tuple[argparse.ArgumentParser, dict]:
    """The parser, and {options class: its flags} of every target's options."""
    from engines.targets import add_target_arguments

    p = argparse.ArgumentParser(prog="python -m engines", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("build_dir", nargs="?", help="the export's output folder (holds onnx/)")
    p.add_argument("--target", default="ort")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--passes", help="comma-separated pass names replacing the target's own list ('' for none); "
                                     "the precision's passes still run after them")
    p.add_argument("--list-passes", action="store_true",
                   help="print every pass, each target's list and each precision's passes, then exit")
    p.add_argument("--force", action="store_true", help="rebuild even if the artifact is up to date")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show what the libraries under the passes print (kept back on success, shown on failure)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the build plan (destination, up to date or not, passes per submodule, calibration) "
                        "and write nothing")
    p.add_argument("--print-artifact", action="store_true",
                   help="print the artifact folder these settings build into (their options name it) and write "
                        "nothing: `make image` runs the folder `make engines` built")
    p.add_argument("--fallback", choices=["ort"], default=None,
                   help="build a submodule the target rejects for ONNX Runtime instead (the manifest says which)")
    p.add_argument("--remove-export", action="store_true",
                   help="delete each submodule's exported graph and weights as soon as its build has read them, "
                        "for a disk that cannot hold a real-size export and its artifact together (the export "
                        "cannot be built again: run python -m export again for another target)")
    flags = add_target_arguments(p)
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
                       help="image side in pixels (default: the model's default size, at most "
                            f"{LARGEST_DEFAULT_SIZE})")
    return p, flags


def _build(args, flags) -> None:
    from engines.api import execute
    from engines.memory.sizes import parse_size
    from engines.plan import describe, plan
    from engines.targets import options_from_args

    build = plan(args.build_dir, args.target, args.precision, options=options_from_args(args.target, args, flags),
                 force=args.force, passes=None if args.passes is None else args.passes.split(","),
                 calibration=CalibrationSettings(args.calibration_prompts, args.calibration_steps, args.calibration_size),
                 fallback=args.fallback, memory=args.memory,
                 memory_budget=parse_size(args.memory_budget) if args.memory_budget is not None else None,
                 remove_export=args.remove_export)
    if args.print_artifact:
        print(build.dest)
    elif args.dry_run:
        print(describe(build))
    else:
        execute(build)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["inspect"]:
        from engines.memory.inspect import main as inspect_main

        return inspect_main(argv[1:])
    if argv[:1] == ["lora"]:
        from engines.lora import main as lora_main

        return lora_main(argv[1:])
    p, flags = _parser()
    args = p.parse_args(argv)

    from engines.passes import PassFailed, UnknownPass, describe_passes, show_library_output
    from engines.precisions import describe_precisions
    from engines.targets import EngineBuildError, SubmoduleBuildFailed, TargetError, describe_targets
    from runners.cli import run_cli
    from runners.manifest import ManifestError

    show_library_output(args.verbose)
    if args.list_passes:
        print(describe_passes() + "\n\n" + describe_targets() + "\n" + describe_precisions())
        return 0
    if args.build_dir is None:
        p.error("BUILD_DIR is required (or --list-passes)")
    return run_cli(lambda: _build(args, flags),
                   (TargetError, ManifestError, PassFailed, UnknownPass, SubmoduleBuildFailed, EngineBuildError, ValueError),
                   "no artifact was written")


if __name__ == "__main__":
    sys.exit(main())
