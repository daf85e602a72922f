"""python -m engines BUILD_DIR --target ort --precision fp32: build an artifact from BUILD_DIR/onnx."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m engines", description=__doc__)
    p.add_argument("build_dir", nargs="?", help="the export's output folder (holds onnx/)")
    p.add_argument("--target", default="ort")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--passes", help="comma-separated pass names replacing the target's own list ('' for none)")
    p.add_argument("--list-passes", action="store_true", help="print every pass and each target's list, then exit")
    p.add_argument("--force", action="store_true", help="rebuild even if the artifact is up to date")
    args = p.parse_args(argv)

    from engines.passes import PassFailed, UnknownPass, describe_passes
    from engines.targets import TargetError, describe_targets

    if args.list_passes:
        print(describe_passes() + "\n\n" + describe_targets())
        return 0
    if args.build_dir is None:
        p.error("BUILD_DIR is required (or --list-passes)")

    from engines.api import build_artifact
    from runners.cli import run_cli
    from runners.manifest import ManifestError

    passes = None if args.passes is None else args.passes.split(",")
    return run_cli(lambda: build_artifact(args.build_dir, args.target, args.precision, force=args.force,
                                          passes=passes),
                   (TargetError, ManifestError, PassFailed, UnknownPass), "no artifact was written")


if __name__ == "__main__":
    sys.exit(main())
