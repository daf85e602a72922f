"""An LLM tokenizer's prompt format, rendered at export so that the runner needs no transformers and no
Jinja: the chat template is applied around a sentinel and stored as the text before and after the prompt.

That is exact only for a template that inserts the prompt as it is (Qwen3's, Mistral's): the rendering is
checked on prompts with the characters a template could escape, trim or interpret, and a template that
changes any of them is refused in one line.
"""
from __future__ import annotations

import json
from pathlib import Path

from export.spec import PromptFormat

_SENTINEL = "\x00PROMPT\x00"
# What a template could touch: quotes, braces and Jinja-like text, markup, a chat token, newlines, outer
# spaces (a `trim` filter), non-ASCII, the empty prompt.
CHECKED_PROMPTS = ('a "quoted" {brace} {{ jinja }} {% raw %} <b>&amp;</b>', "  two\nlines\t ", "<|im_end|> é 東京 🚀",
                   "")


def load_tokenizer(folder: Path):
    """transformers' tokenizer of a pipeline's tokenizer folder, with the chat template a processor's folder keeps
    in `chat_template.json` (FLUX.2 dev's PixtralProcessor: AutoTokenizer reads only chat_template.jinja and the
    tokenizer config)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    legacy = Path(folder) / "chat_template.json"
    if tok.chat_template is None and legacy.exists():
        tok.chat_template = json.loads(legacy.read_text())["chat_template"]
    return tok


def _chat(tok, prompt: str, fmt: PromptFormat) -> str:
    def turn(role, text):
        return {"role": role, "content": [{"type": "text", "text": text}] if fmt.parts else text}

    messages = ([turn("system", fmt.system)] if fmt.system is not None else []) + [turn("user", prompt)]
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=fmt.generation_prompt,
                                   **(fmt.chat or {}))


def rendered(tok, fmt: PromptFormat, name: str) -> dict:
    """The manifest's entry for `fmt` on the transformers tokenizer `tok`: the template's prefix and
    suffix, the tokens to drop and the padding rule."""
    if fmt.padding not in ("max_length", "longest"):
        raise ValueError(f"{name}: padding {fmt.padding!r}: use max_length or longest")
    if fmt.template is not None:
        prefix, suffix = fmt.template.split("{}")
        apply = fmt.template.format
    else:
        prefix, found, suffix = _chat(tok, _SENTINEL, fmt).partition(_SENTINEL)
        if not found:
            raise ValueError(f"{name}: its chat template does not contain the prompt as given; it cannot be stored "
                             f"as a prefix and suffix")
        apply = lambda prompt: _chat(tok, prompt, fmt)  # noqa: E731
    for prompt in CHECKED_PROMPTS:
        if apply(prompt) != prefix + prompt + suffix:
            raise ValueError(f"{name}: its chat template changes the prompt {prompt!r} (escapes, trims or interprets "
                             f"it): the runner's prefix + prompt + suffix would differ; this template is not supported")
    return {"template": {"prefix": prefix, "suffix": suffix}, "drop_tokens": fmt.drop_tokens, "padding": fmt.padding,
            "removed": list(fmt.removed)}
