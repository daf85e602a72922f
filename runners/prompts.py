"""Prompts to a text encoder's embeddings for the families whose encoder reads an attention mask (an
LLM, a masked T5): tokenized in the artifact's template (runners/text.py), encoded, and shaped by the
post-step the family's pipeline reads them with:

- "dense": the encoder's output as it is, padding included (FLUX.2 klein pads to 512 and reads all);
- "trimmed": each prompt's real tokens only, a list of (length_i, width) arrays (Z-Image);
- "repadded": the template's leading tokens dropped, padded to the longest prompt, with a mask (Qwen-Image);
- "zeroed": zeros past each prompt's length (Wan's UMT5).

The tokenizer's padding rule says how long the encoder runs: "longest" (the longest prompt of the call)
where the family reads only real tokens of a causal encoder, whose hidden states do not depend on what
follows them; "max_length" where the family reads the padding too.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Encoded(NamedTuple):
    embeds: np.ndarray  # (prompts, length, width) float32
    mask: np.ndarray  # (prompts, length) int64: 1 on each prompt's tokens

    @property
    def lengths(self) -> np.ndarray:
        return self.mask.sum(axis=1)


def _dense(encoded: Encoded) -> Encoded:
    return encoded


def _trimmed(encoded: Encoded) -> list[np.ndarray]:
    return [e[m.astype(bool)] for e, m in zip(encoded.embeds, encoded.mask)]


def _repadded(encoded: Encoded) -> Encoded:
    longest = int(encoded.lengths.max())
    mask = encoded.mask[:, :longest]
    return Encoded(np.where(mask[..., None].astype(bool), encoded.embeds[:, :longest], 0).astype(np.float32), mask)


def _zeroed(encoded: Encoded) -> Encoded:
    return Encoded(encoded.embeds * encoded.mask[..., None].astype(np.float32), encoded.mask)


POST_STEPS = {"dense": _dense, "trimmed": _trimmed, "repadded": _repadded, "zeroed": _zeroed}


def encode_prompts(pipeline, encoder: str, tokenizer: str, prompts: list[str], max_length: int,
                   post: str = "dense") -> Encoded | list[np.ndarray]:
    """`prompts` through `tokenizer` (at most `max_length` tokens each, template included) and the engine
    `encoder` (inputs input_ids, attention_mask; its first output the hidden states), the template's
    dropped tokens removed, shaped by `post` (POST_STEPS)."""
    tok = pipeline.tokenizers[tokenizer]
    tokens = tok.encode(prompts, max_length)
    outputs = pipeline.run(encoder, input_ids=tokens.ids, attention_mask=tokens.mask)
    embeds = outputs[pipeline.manifest["submodules"][encoder]["outputs"][0]["name"]]
    drop = tok.drop_tokens
    return POST_STEPS[post](Encoded(embeds[:, drop:], tokens.mask[:, drop:]))
