"""The backend contract on outputs (runners/backends/__init__.py): a session may reuse its output
buffers, as polygraphy's TrtRunner does. Every pipeline path that keeps an output past the next call
(the tiled VAE, PLMS's history, vae_decode and vae_encode results) runs here on a backend that does,
and must give ONNX Runtime's images exactly. Also: closing a pipeline frees every session."""
from __future__ import annotations

import gc

import numpy as np
import pytest

from conftest import image_task_outputs
from gpu_double import SharedBuffers
from runners.pipeline import Pipeline

PROMPTS = ["a photo of a cat", "a red bicycle"]


def _both(monkeypatch, artifact, run):
    """`run(pipe)` on the plain ONNX Runtime pipeline, then on the shared-buffer one."""
    ref = run(Pipeline.load(artifact))
    double = SharedBuffers.install(monkeypatch, artifact)
    got = run(Pipeline.load(artifact))
    assert double.opened and all(s.calls or s.closed for s in double.opened)
    return ref, got


def test_the_double_reuses_its_buffers(monkeypatch, tiny_artifact):
    """The stand-in really does what TrtRunner does: the first call's output changes under the caller."""
    SharedBuffers.install(monkeypatch, tiny_artifact)
    pipe = Pipeline.load(tiny_artifact, submodules=["vae_decoder"])
    session = pipe.sessions["vae_decoder"]
    rng = np.random.default_rng(0)
    first = session.run({"latent": rng.standard_normal((1, 16, 16, 16), dtype=np.float32)})["image"]
    kept = first.copy()
    second = session.run({"latent": rng.standard_normal((1, 16, 16, 16), dtype=np.float32)})["image"]
    assert np.shares_memory(first, second) and not np.array_equal(first, kept)


@pytest.mark.parametrize("guidance", [7.0, 1.0], ids=["guidance", "no-guidance"])
def test_sd3_text_to_image(monkeypatch, tiny_artifact, guidance):
    def run(pipe):
        return pipe(PROMPTS, num_inference_steps=3, guidance_scale=guidance, num_images_per_prompt=2, seed=1,
                    output_type="np")

    ref, got = _both(monkeypatch, tiny_artifact, run)
    assert ref.shape == (4, 128, 128, 3) and np.array_equal(got, ref)


def test_tiled_and_repeated_vae(monkeypatch, tiny_artifact):
    rng = np.random.default_rng(2)
    z1, z2 = (rng.standard_normal((1, 16, 40, 24), dtype=np.float32) for _ in range(2))

    def run(pipe):
        first = pipe.vae_decode(z1, tiling=True, tile_size=16)  # 4 x 3 tiles of the same size, blended after
        second = pipe.vae_decode(z2)  # the first result must survive the next call
        mean1, logvar1 = pipe.vae_encode(first, tiling=True, tile_size=128)
        mean2, _ = pipe.vae_encode(second)
        return first, second, mean1, logvar1, mean2

    ref, got = _both(monkeypatch, tiny_artifact, run)
    for r, g in zip(ref, got):
        assert np.array_equal(g, r)


@pytest.mark.parametrize("fixture", ["sd3_tiny_build", "sd15_tiny_build"])
def test_image_tasks(monkeypatch, request, fixture):
    """Image to image and inpainting keep the image's latents across every step (blended back, re-noised)."""
    artifact = request.getfixturevalue(fixture).folder / "ort-fp32"
    ref, got = _both(monkeypatch, artifact, lambda pipe: image_task_outputs(pipe, steps=3))
    for task in ref:
        assert np.array_equal(got[task], ref[task]), task


@pytest.mark.parametrize("guidance", [7.5, 1.0], ids=["guidance", "no-guidance"])
def test_sd15_plms(monkeypatch, sd15_tiny_build, guidance):
    """PNDM (PLMS) keeps up to four past noise predictions; without guidance they are the engine's own."""
    artifact = sd15_tiny_build.folder / "ort-fp32"

    def run(pipe):
        assert type(pipe.scheduler).__name__ == "PNDM"
        return pipe(PROMPTS[:1], num_inference_steps=5, guidance_scale=guidance, seed=3, output_type="np")

    ref, got = _both(monkeypatch, artifact, run)
    assert np.array_equal(got, ref)


def test_sdxl_text_to_image(monkeypatch, sdxl_tiny_build):
    artifact = sdxl_tiny_build.folder / "ort-fp32"
    ref, got = _both(monkeypatch, artifact, lambda pipe: pipe(PROMPTS, negative_prompt="blurry", num_inference_steps=3,
                                                              seed=4, output_type="np"))
    assert np.array_equal(got, ref)


def test_close_frees_every_session(monkeypatch, tiny_artifact, tmp_path):
    double = SharedBuffers.install(monkeypatch, tiny_artifact)
    with Pipeline.load(tiny_artifact) as pipe:
        n = len(pipe.sessions)
        pipe("a cat", num_inference_steps=1, output_type="latent")
        # A profiled run closes the plain engines before it opens its own, and the reverse after.
        pipe("a cat", num_inference_steps=1, output_type="latent", profile=tmp_path / "profile")
        assert double.live == n and len(double.opened) == 3 * n
    assert double.live == 0 and pipe.sessions == {}
    with pytest.raises(RuntimeError, match="this pipeline was closed .*load .* again to run it"):
        pipe("a cat", num_inference_steps=1)
    Pipeline.load(tiny_artifact)  # dropped without close(): __del__ frees it
    gc.collect()
    assert double.live == 0


def test_a_failed_open_closes_what_it_opened(monkeypatch, tiny_artifact):
    double = SharedBuffers.install(monkeypatch, tiny_artifact)
    real = double.open

    def fail_on_the_vae(target, path, **options):
        if "vae_decoder" in str(path):
            raise RuntimeError("out of device memory (test)")
        return real(target, path, **options)

    monkeypatch.setattr("runners.pipeline.open_session", fail_on_the_vae)
    with pytest.raises(RuntimeError, match="out of device memory"):
        Pipeline.load(tiny_artifact)
    assert double.opened and double.live == 0
