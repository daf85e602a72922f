"""A user folder holding an SD3 pipeline saved without T5 exports, builds and runs like diffusers:
five submodules, and zeros in place of the T5 embeddings."""
from __future__ import annotations

import numpy as np
import torch

from runners import Pipeline
from conftest import manifest


def test_pipeline_saved_without_t5(tmp_path, reference_pipeline, shared_root, tiny_build):
    from diffusers import StableDiffusion3Pipeline

    from engines.api import build_artifact
    from export.api import export_model

    folder = tmp_path / "sd3-no-t5"
    parts = {k: v for k, v in reference_pipeline.components.items() if k not in ("text_encoder_3", "tokenizer_3")}
    no_t5 = StableDiffusion3Pipeline(**parts, text_encoder_3=None, tokenizer_3=None)
    no_t5.save_pretrained(folder)
    no_t5.set_progress_bar_config(disable=True)

    # The saved components are sd3-tiny's: their graphs are linked from the session's export, the
    # text encoders and the transformer taking no T5 input export alike (the keys say).
    export_model(str(folder), tmp_path / "build", image_size=(64, 128, 512), reuse_from=shared_root)
    artifact = build_artifact(tmp_path / "build", "ort", "fp32")
    assert "text_encoder_3" not in manifest(artifact)["submodules"]
    assert len(manifest(artifact)["submodules"]) == 6  # no T5; the First-Block Cache's graph beside the transformer

    latents = np.random.default_rng(0).standard_normal((1, 16, 8, 8), dtype=np.float32)
    kwargs = dict(prompt="a photo of a cat", height=64, width=64, num_inference_steps=4, max_sequence_length=32)
    ours = Pipeline.load(artifact)(latents=latents, output_type="np", **kwargs)
    ref = no_t5(latents=torch.from_numpy(latents), output_type="np", **kwargs).images
    assert np.abs(ours - ref).max() <= 1 / 255
