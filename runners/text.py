"""Tokenization with the model's own tokenizer.json through the `tokenizers` library, with the
padding and truncation semantics diffusers asks of transformers (pad to a fixed length or to the
longest prompt, truncate keeping the special tokens, warn about what was cut), and an LLM's chat
template as the export rendered it around the prompt (its prefix and suffix, export/prompt_formats.py)."""
from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np
from tokenizers import Tokenizer

log = logging.getLogger("runners")

PADDINGS = ("max_length", "longest")


class Tokens(NamedTuple):
    ids: np.ndarray  # (prompts, length) int64
    mask: np.ndarray  # (prompts, length) int64: 1 on each prompt's tokens, 0 on the padding

    @property
    def lengths(self) -> np.ndarray:
        return self.mask.sum(axis=1)


class TextTokenizer:
    def __init__(self, path, entry: dict, name: str):
        """`entry`: the manifest's tokenizer entry: pad_token_id, and for an LLM's its template
        ({prefix, suffix}), padding rule and the template tokens the pipeline drops."""
        self.name = name
        self._tok = Tokenizer.from_file(str(path))
        self._pad_id = entry["pad_token_id"]
        self._pad_token = self._tok.id_to_token(self._pad_id)
        template = entry.get("template") or {}
        self.prefix, self.suffix = template.get("prefix", ""), template.get("suffix", "")
        self.padding = entry.get("padding", "max_length")
        self.padding_side = entry.get("padding_side", "right")
        self.drop_tokens = entry.get("drop_tokens", 0)  # the template's leading tokens the pipeline drops
        self.removed = tuple(entry.get("removed", ()))  # text the pipeline removes from each prompt first
        # CLIP's BPE marks word ends with "</w>", which its ByteLevel decoder leaves in place.
        self._word_end = getattr(self._tok.model, "end_of_word_suffix", None) or None
        # CLIP's and T5's post-processors end every text with an end token, which truncation keeps; an LLM's add none
        plain, special = (self._tok.encode("a", add_special_tokens=s).ids for s in (False, True))
        self._adds_end = special[-1:] != plain[-1:]

    def __call__(self, texts: list[str], length: int) -> np.ndarray:
        """Token ids (len(texts), length), int64: specials added, truncated, padded to `length`."""
        return self.encode(texts, length, padding="max_length").ids

    def encode(self, texts: list[str], max_length: int, padding: str | None = None) -> Tokens:
        """Each text in the template, tokenized with specials, truncated to `max_length` tokens and padded
        by `padding` (default: the tokenizer's rule): to `max_length`, or to the longest text."""
        padding = padding or self.padding
        tok = self._tok
        texts = [f"{self.prefix}{self._without_removed(t)}{self.suffix}" for t in texts]
        tok.no_padding()
        tok.no_truncation()
        full = tok.encode_batch(texts)
        tok.enable_truncation(max_length=max_length)
        longest = min(max(len(e.ids) for e in full), max_length)
        tok.enable_padding(length=max_length if padding == "max_length" else longest, pad_id=self._pad_id,
                           pad_token=self._pad_token, direction=self.padding_side)
        encoded = tok.encode_batch(texts)
        for whole in full:
            if len(whole.ids) > max_length:
                self._warn_truncated(whole.ids, max_length)
        return Tokens(np.array([e.ids for e in encoded], dtype=np.int64),
                      np.array([e.attention_mask for e in encoded], dtype=np.int64))

    def _without_removed(self, text: str) -> str:
        for removed in self.removed:
            text = text.replace(removed, "")
        return text

    def _warn_truncated(self, ids: list[int], length: int) -> None:
        removed = self._tok.decode(ids[length - 1 : -1] if self._adds_end else ids[length:])
        if self._word_end:
            removed = removed.replace(self._word_end, " ").strip()
        log.warning("%s: the following part of the prompt was truncated to %d tokens: %r", self.name, length, removed)
