"""Failures while a stage writes: a full disk or Ctrl-C (during a calibration run, too) leaves no
half-written folder, and the command says so in one line."""
from __future__ import annotations

import errno
import shutil

import pytest


@pytest.fixture
def export_copy(tiny_build, tmp_path):
    """A build folder of its own, holding only sd3-tiny's export."""
    shutil.copytree(tiny_build / "onnx", tmp_path / "build" / "onnx")
    return tmp_path / "build"


def _leftovers(folder):
    return sorted(p.name for p in folder.rglob("*") if ".tmp-" in p.name or ".old-" in p.name)


def test_full_disk_while_writing_an_artifact(export_copy, monkeypatch, capsys):
    import runners.manifest
    from engines.__main__ import main

    def full(model, path, **options):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(runners.manifest, "save_graph", full)
    assert main([str(export_copy)]) == 2
    err = capsys.readouterr().err
    assert "error: no space left on the disk writing " in err
    assert "free some space and run the command again" in err and "Traceback" not in err
    assert not (export_copy / "ort-fp32").exists() and _leftovers(export_copy) == []


def test_ctrl_c_during_calibration(export_copy, monkeypatch, capsys):
    """Interrupted after the first calibration prompt: the fp32 artifact it needed stays (complete),
    the calibration folder and the fp16 artifact are absent, and the command exits 130."""
    from engines.__main__ import main
    from runners.text_to_image import TextToImage

    calls = []
    real = TextToImage.__call__

    def interrupted(self, *args, **kwargs):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TextToImage, "__call__", interrupted)
    assert main([str(export_copy), "--precision", "fp16", "--calibration-prompts", "4",
                 "--calibration-steps", "1", "--calibration-size", "64"]) == 130
    err = capsys.readouterr().err
    assert "interrupted:" in err and "Traceback" not in err
    assert calls == [1]
    assert (export_copy / "ort-fp32" / "manifest.json").exists()
    assert not (export_copy / "ort-fp16").exists()
    assert not any((export_copy / "calibration").iterdir()) and _leftovers(export_copy) == []
