"""python -m engines BUILD_DIR --target ort --precision fp32: build an artifact from BUILD_DIR/onnx."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m engines", description=__doc__)
    p.add_argument("build_dir", help="the export's output folder (holds onnx/)")
    p.add_argument("--target", default="ort")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--force", action="store_true", help="rebuild even if the artifact is up to date")
    args = p.parse_args(argv)

    from engines.api import build_artifact
    from engines.targets import TargetError
    from runners.cli import run_cli
    from runners.manifest import ManifestError

    return run_cli(lambda: build_artifact(args.build_dir, args.target, args.precision, force=args.force),
                   (TargetError, ManifestError), "no artifact was written")


if __name__ == "__main__":
    sys.exit(main())
