"""Real-size models on a small machine: random weights streamed tensor by tensor load through
from_pretrained like a real checkpoint (proven on sd3-tiny's configs), and sd3-fullsize has
SD3-medium's true shapes."""
from __future__ import annotations

import json

import pytest
import torch

from export.registry import MODELS, SD3_TINY


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    from export.families.sd3 import build_random

    out = tmp_path_factory.mktemp("streamed") / "sd3"
    build_random({**SD3_TINY, "weights_dtype": "float16", "t5_vocab_size": 2000}, out)
    return out


def test_streamed_weights_load_like_a_checkpoint(streamed):
    from diffusers import StableDiffusion3Pipeline
    from diffusers.utils import logging

    index = json.loads((streamed / "model_index.json").read_text())
    assert index["text_encoder_3"] == ["transformers", "T5EncoderModel"] and index["_class_name"] == "StableDiffusion3Pipeline"
    header_bytes = (streamed / "text_encoder_3" / "model.safetensors").read_bytes()[:8]
    header = json.loads((streamed / "text_encoder_3" / "model.safetensors").read_bytes()[8:8 + int.from_bytes(header_bytes, "little")])
    assert "encoder.embed_tokens.weight" not in header and header["shared.weight"]["shape"] == [2000, 96]  # tied: once
    logging.set_verbosity_warning()
    pipe = StableDiffusion3Pipeline.from_pretrained(streamed, dtype=torch.float16)
    t5 = pipe.text_encoder_3
    assert t5.shared.weight.dtype == torch.float16 and t5.encoder.embed_tokens.weight is t5.shared.weight
    weight = pipe.transformer.transformer_blocks[0].attn.to_q.weight.float()
    assert abs(weight.std().item() - 0.02) < 0.002 and pipe.transformer.transformer_blocks[0].attn.to_q.bias.abs().max() == 0


def test_sd3_fullsize_has_the_true_sd3_medium_shapes():
    from diffusers import SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    cfg = MODELS["sd3-fullsize"].random_configs
    with torch.device("meta"):
        count = {
            "transformer": SD3Transformer2DModel(**cfg["transformer"]),
            "text_encoder_2": CLIPTextModelWithProjection(CLIPTextConfig(**cfg["text_encoder_2"])),
            "text_encoder_3": T5EncoderModel(T5Config(vocab_size=cfg["t5_vocab_size"], **cfg["text_encoder_3"])),
        }
        count = {name: sum(p.numel() for p in m.parameters()) for name, m in count.items()}
    assert count == {"transformer": 2_028_328_000, "text_encoder_2": 694_659_840, "text_encoder_3": 4_762_310_656}
    assert cfg["weights_dtype"] == "float16"

