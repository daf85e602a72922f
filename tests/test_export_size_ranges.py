"""An --image-size range whose example size gives a graph's deepest level a side of 1 is refused in one
line before anything is traced (issue 54): torch.export specializes a size of 1, and the U-Net with
ControlNet inputs then fails deep in its trace, the other graphs trace but are wrong at other sizes."""
from __future__ import annotations

import dataclasses

import pytest

from export import api, onnx_export
from export.__main__ import main
from export.families import flux, sd3, sdxl
from export.registry import MODELS
from export.shapes import check_example_size


class Traced(Exception):
    """Raised in place of tracing: reaching it means every check before tracing passed."""


@pytest.fixture
def no_tracing(monkeypatch):
    def traced(*args, **kwargs):
        raise Traced

    monkeypatch.setattr(api, "export_submodule", traced)
    monkeypatch.setattr(onnx_export, "trace", traced)


def _export(out, sizes: str) -> int:
    return main(["sd15-tiny", "--out", str(out), "--image-size", sizes, "--controlnet", "sd15-controlnet-tiny"])


def test_a_range_sd15s_unet_cannot_trace_is_refused_in_one_line_before_tracing(tmp_path, no_tracing, capsys):
    assert _export(tmp_path / "build", "64,64,128") == 2
    assert capsys.readouterr().err == (
        "error: --image-size 64,64,128: the example size 64 gives sd15-tiny's unet a deepest latent side of 1 "
        "(64 px / 8 / 8), which torch.export cannot keep dynamic; use an opt size of at least 128 "
        "(a multiple of 64)\n")
    assert not (tmp_path / "build").exists()


def test_a_range_with_a_min_of_one_deepest_cell_passes_the_check(tmp_path, no_tracing):
    """64,128,256: traced at 128 (a deepest side of 2), the graphs are right down to 64 (a side of 1)."""
    with pytest.raises(Traced):
        _export(tmp_path / "build", "64,128,256")


# Each family's denoiser declares its divisor: (constants, refused range, accepted range, the graph named).
FAMILIES = {
    "sdxl": (sdxl.FAMILY, {"vae_scale_factor": 8, "latent_multiple": 4}, (32, 32, 64), (32, 64, 128), "unet"),
    "sd3": (sd3.FAMILY, {"vae_scale_factor": 8, "latent_multiple": 2}, (16, 16, 32), (16, 32, 64), "transformer"),
    "flux": (flux.FAMILY, {"vae_scale_factor": 8, "latent_multiple": 2}, (16, 16, 32), (16, 32, 64), "transformer"),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_denoiser_needs_a_deepest_side_of_two(family):
    described, constants, refused, accepted, graph = FAMILIES[family]
    entry = MODELS[f"{family}-tiny"]
    with pytest.raises(ValueError, match=f"gives {family}-tiny's {graph} a deepest latent side of 1"):
        check_example_size(dataclasses.replace(entry, image_size=refused), described.submodules, constants)
    check_example_size(dataclasses.replace(entry, image_size=accepted), described.submodules, constants)
