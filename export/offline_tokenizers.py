"""Real tokenizers without a network: CLIP's BPE table from the open-clip-torch wheel, byte-level BPEs of
Qwen's and Mistral's kinds and a SentencePiece T5 vocabulary, trained in a second on synthetic prompts.

They are written as ordinary Hugging Face tokenizer folders, so the tiny pipelines load them through the
same `from_pretrained` code as a downloaded model.
"""
from __future__ import annotations

import gzip
import importlib.util
import io
import json
import random
import tempfile
from pathlib import Path

CLIP_BPE_FILE = "bpe_simple_vocab_16e6.txt.gz"
CLIP_MERGES = 49152 - 256 - 2  # the table CLIP itself uses: 48,894 merges, 49,408 tokens


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def clip_bpe_path() -> Path:
    # find_spec locates the wheel without importing open_clip (which wants torchvision).
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the CLIP BPE table comes from the open-clip-torch wheel: "
            "pip install --no-deps open-clip-torch (the Makefile does this)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / CLIP_BPE_FILE


def write_clip_tokenizer(out_dir: Path, pad_token: str) -> None:
    """CLIP's real vocabulary; `pad_token` is "<|endoftext|>" for CLIP-L and "!" for CLIP-G in SD3."""
    from transformers import CLIPTokenizer

    lines = gzip.open(clip_bpe_path(), "rt", encoding="utf-8").read().split("\n")[1 : CLIP_MERGES + 1]
    merges = [tuple(line.split()) for line in lines]
    vocab = list(_bytes_to_unicode().values())
    vocab += [v + "</w>" for v in vocab]
    vocab += ["".join(m) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    with tempfile.TemporaryDirectory() as tmp:
        vocab_file, merges_file = Path(tmp, "vocab.json"), Path(tmp, "merges.txt")
        vocab_file.write_text(json.dumps({tok: i for i, tok in enumerate(vocab)}))
        merges_file.write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
        tok = CLIPTokenizer(str(vocab_file), str(merges_file), pad_token=pad_token, model_max_length=77)
        tok.save_pretrained(out_dir)


_SUBJECTS = "cat dog astronaut castle forest city robot dragon flower ocean mountain car portrait bird".split()
_STYLES = "photo painting sketch render illustration watercolor drawing photograph".split()
_ADJECTIVES = "red blue golden dark bright misty ancient futuristic tiny huge cozy detailed".split()
_PLACES = "on the moon in a garden under the sea at sunset in the rain on a table in space".split(" in ")


def _synthetic_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        f"a {rng.choice(_ADJECTIVES)} {rng.choice(_STYLES)} of a {rng.choice(_ADJECTIVES)} "
        f"{rng.choice(_SUBJECTS)} in {rng.choice(_PLACES)}, {rng.choice(_ADJECTIVES)} light"
        for _ in range(n)
    ]


def write_t5_tokenizer(out_dir: Path, vocab_size: int, seed: int = 0) -> int:
    """Train a SentencePiece unigram model with T5's special ids (pad 0, eos 1, unk 2).

    Returns the tokenizer's full size (the pieces plus T5's 100 sentinel tokens), which the
    T5 config's vocab_size must cover.
    """
    import sentencepiece as spm
    from transformers import T5TokenizerFast

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_synthetic_prompts(2000, seed)),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="unigram",
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "spiece.model").write_bytes(model.getvalue())
        # transformers 5 ignores T5TokenizerFast(vocab_file=...): load the folder instead.
        tok = T5TokenizerFast.from_pretrained(tmp, model_max_length=512)
        tok.save_pretrained(out_dir)
        return len(tok)


# Qwen2's pre-tokenizer (Qwen3 and Qwen2.5-VL share it): this split, then byte-level BPE on each piece.
_QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_ADDED_TOKENS = ("<think>", "</think>")  # ordinary added tokens in Qwen3 (not special)
# Qwen2.5-VL's special tokens: the chat tokens, then the grounding and vision ones (its processor's image
# placeholder <|image_pad|> among them), in its order
QWEN_VL_SPECIAL_TOKENS = (*QWEN_SPECIAL_TOKENS, "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
                          "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                          "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


def write_qwen_tokenizer(out_dir: Path, vocab_size: int, chat_template: str, seed: int = 0,
                         special: tuple[str, ...] = QWEN_SPECIAL_TOKENS, added: tuple[str, ...] = QWEN_ADDED_TOKENS,
                         whole: str = "") -> int:
    """A Qwen2-kind tokenizer (byte-level BPE with Qwen's split, NFC, its `special` tokens, pad <|endoftext|>)
    trained on synthetic prompts, with `chat_template` (the real model's Jinja template). `whole`: text whose
    words the training sees often enough to make each one token, as Qwen's vocabulary has them (a pipeline's
    template, whose token count it relies on). Returns its size, which the LLM config's vocab_size must cover."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_synthetic_prompts(2000, seed) + [whole] * (1000 if whole else 0), trainer)
    tok.add_special_tokens(list(special))  # after the vocabulary, in Qwen's order
    tok.add_tokens(list(added))
    fast = Qwen2TokenizerFast(tokenizer_object=tok, unk_token=None, bos_token=None, eos_token="<|im_end|>",
                              pad_token="<|endoftext|>", model_max_length=131072, chat_template=chat_template)
    fast.save_pretrained(out_dir)
    return len(fast)


# Mistral's tekken tokenizer (Mistral Small 3's, FLUX.2 dev's encoder's): this split, then byte-level BPE; its
# control tokens come first, in tekken's order ([IMG] is 10, as the processor's image_token_index).
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
                 r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                         "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]",
                         "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                         "[TOOL_CONTENT]")


def mistral_tokenizer(vocab_size: int, chat_template: str, padding_side: str, seed: int = 0):
    """A Mistral-kind tokenizer (tekken's split and byte-level BPE, its control tokens first, <s> before each
    text by the template, pad <pad>) trained on synthetic prompts, with `chat_template` (the real model's); the
    transformers tokenizer, whose length the LLM config's vocab_size must cover."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_TEKKEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True) for t in TEKKEN_SPECIAL_TOKENS]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=specials, show_progress=False)
    tok.train_from_iterator(_synthetic_prompts(2000, seed), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", model_max_length=131072, padding_side=padding_side,
                                   chat_template=chat_template)
