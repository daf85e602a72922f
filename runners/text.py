"""Tokenization with the model's own tokenizer.json through the `tokenizers` library, with the
padding and truncation semantics diffusers asks of transformers (pad to a fixed length,
truncate keeping the special tokens, warn about what was cut)."""
from __future__ import annotations

import logging

import numpy as np
from tokenizers import Tokenizer

log = logging.getLogger("runners")


class TextTokenizer:
    def __init__(self, path, pad_token_id: int, name: str):
        self.name = name
        self._tok = Tokenizer.from_file(str(path))
        self._pad_id = pad_token_id
        self._pad_token = self._tok.id_to_token(pad_token_id)
        # CLIP's BPE marks word ends with "</w>", which its ByteLevel decoder leaves in place.
        self._word_end = getattr(self._tok.model, "end_of_word_suffix", None) or None

    def __call__(self, texts: list[str], length: int) -> np.ndarray:
        """Token ids (len(texts), length), int64: specials added, truncated, padded."""
        tok = self._tok
        tok.no_padding()
        tok.no_truncation()
        full = tok.encode_batch(texts)
        tok.enable_truncation(max_length=length)
        tok.enable_padding(length=length, pad_id=self._pad_id, pad_token=self._pad_token)
        encoded = tok.encode_batch(texts)
        for text, whole, cut in zip(texts, full, encoded):
            if len(whole.ids) > length:
                removed = tok.decode(whole.ids[length - 1 : -1])
                if self._word_end:
                    removed = removed.replace(self._word_end, " ").strip()
                log.warning("%s: the following part of the prompt was truncated to %d tokens: %r",
                            self.name, length, removed)
        return np.array([e.ids for e in encoded], dtype=np.int64)
