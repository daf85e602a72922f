"""The OpenVINO table's builds, run in a child process of `python -m bench`: our ort-int8 and
openvino-fp32/-bf16/-int8 artifacts beside the default ort-fp32 one, and the steps from plain
OpenVINO to our default, each one change on top of the previous:
- openvino-bf16 without our passes, dynamic shapes: plain OpenVINO on our export;
- with our passes (what the passes add), then the default per-size shapes (what static shapes add);
- openvino-int8 with dynamic shapes, then per-size (int8 alone, and shapes on top of it);
- openvino-int8 compiled for the CPU at build time for the table's size (`--ov-device CPU
  --ov-sizes`: static shapes built for a list of sizes, and the ahead-of-time load).

The variants that differ from a default artifact in more than target and precision are built
through the same API into sibling build folders whose export, fp32 artifact and calibration are
links to this one's: the same graphs and recordings, but folders of their own (an artifact's name
says its target and precision, not its passes, shapes or device).
"""
from __future__ import annotations

import os
from pathlib import Path

def _sibling(build: Path, name: str) -> Path:
    """A build folder beside `build` that shares its export, fp32 artifact and calibration."""
    sibling = build / name
    sibling.mkdir(exist_ok=True)
    for shared in ("onnx", "ort-fp32", "calibration"):
        link = sibling / shared
        if not os.path.lexists(link):  # a link made before its target exists (calibration) is kept
            os.symlink(Path("..") / shared, link)
    return sibling


def build_openvino(build: Path, calibration: dict, size: int, only: list[str] | None = None) -> dict[str, str]:
    """{artifact label: folder} (`only`: those labels); every build is cached like `python -m engines`."""
    from engines.api import build_artifact
    from engines.calibration import CalibrationSettings
    from engines.targets.openvino import OpenVinoOptions

    settings = CalibrationSettings(**calibration)
    dynamic = OpenVinoOptions(shapes="dynamic")
    int8 = build_artifact(build, "openvino", "int8", calibration=settings)  # first: its recordings are shared
    builds = {"ort-int8": lambda: build_artifact(build, "ort", "int8"),
              "openvino-fp32": lambda: build_artifact(build, "openvino", "fp32"),
              "openvino-bf16, no passes, dynamic shapes": lambda: build_artifact(
                  _sibling(build, "no-passes"), "openvino", "bf16", passes=[], options=dynamic),
              "openvino-bf16, dynamic shapes": lambda: build_artifact(_sibling(build, "dynamic"), "openvino", "bf16",
                                                                      options=dynamic),
              "openvino-bf16": lambda: build_artifact(build, "openvino", "bf16"),
              "openvino-int8, dynamic shapes": lambda: build_artifact(
                  _sibling(build, "dynamic"), "openvino", "int8", calibration=settings, options=dynamic),
              "openvino-int8": lambda: int8,
              f"openvino-int8, compiled for CPU at {size}x{size}": lambda: build_artifact(
                  _sibling(build, "compiled-cpu"), "openvino", "int8", calibration=settings,
                  options=OpenVinoOptions(device="CPU", sizes=((size, size),)))}
    unknown = set(only or ()) - set(builds)
    if unknown:
        raise ValueError(f"openvino table: no variant {', '.join(sorted(unknown))}; they are: {', '.join(builds)}")
    return {label: str(make()) for label, make in builds.items() if only is None or label in only}
