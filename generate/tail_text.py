"""Whether decoded text ends with one of some strings, decoding only a tail of the ids (the reflective decoder's
trigger points, Speculative Thinking's delimiters)."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from redumix.data.chat import decode_text


def text_ends_with(
    tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], endings: Sequence[str], skip_special_tokens: bool
) -> bool:
    """Whether `ids`, decoded, end with one of `endings` (never when there are none).

    Decodes only the last few tokens: at least one char per token is assumed, plus two spare tokens, so that a token
    cut at the window's start (a stripped leading space, a split UTF-8 byte of a byte-level BPE) cannot change the
    tail. The window doubles while its text is still too short, so an ending that spans token boundaries is found.
    """
    if not endings:
        return False
    longest = max(len(s) for s in endings)
    n = longest + 2
    while True:
        text = decode_text(tokenizer, ids[-n:], skip_special_tokens)
        if len(text) >= longest + 2 or n >= len(ids):
            return text.endswith(tuple(endings))
        n *= 2
