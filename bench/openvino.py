"""The OpenVINO table's builds, run in a child process of `python -m bench`: our ort-int8 and
openvino-fp32/-bf16/-int8 artifacts beside the default ort-fp32 one; openvino-bf16 without our
passes (plain OpenVINO on our export: what the passes add); and openvino-int8 compiled for the CPU
at build time (`--ov-device CPU`), whose load time is the ahead-of-time part.

The last two are built through the same API into sibling build folders whose export, fp32 artifact
and calibration are links to this one's: the same graphs and recordings, but folders of their own
(an artifact's name says its target and precision, not its passes or device).
"""
from __future__ import annotations

import os
from pathlib import Path

OPENVINO = ("openvino-fp32", "openvino-bf16", "openvino-int8")


def _sibling(build: Path, name: str) -> Path:
    """A build folder beside `build` that shares its export, fp32 artifact and calibration."""
    sibling = build / name
    sibling.mkdir(exist_ok=True)
    for shared in ("onnx", "ort-fp32", "calibration"):
        link = sibling / shared
        if not link.exists():
            os.symlink(Path("..") / shared, link)
    return sibling


def build_openvino(build: Path, calibration: dict) -> dict[str, str]:
    """{artifact label: folder}; every build is cached like `python -m engines`."""
    from engines.api import build_artifact
    from engines.calibration import CalibrationSettings
    from engines.targets import BuildOptions

    settings = CalibrationSettings(**calibration)
    built = {"ort-int8": build_artifact(build, "ort", "int8")}
    # What our passes add to OpenVINO: its bf16 on our plain export.
    built["openvino-bf16, no passes"] = build_artifact(_sibling(build, "no-passes"), "openvino", "bf16", passes=[])
    for name in OPENVINO:
        built[name] = build_artifact(build, *name.split("-"), calibration=settings)
    built["openvino-int8, compiled for CPU"] = build_artifact(_sibling(build, "compiled-cpu"), "openvino", "int8",
                                                              calibration=settings, options=BuildOptions(device="CPU"))
    return {label: str(path) for label, path in built.items()}
