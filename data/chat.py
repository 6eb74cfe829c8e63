"""Chat-template rendering that keeps generated tokens verbatim.

A multi-turn context such as x2 = [x ‖ y1 ‖ r ‖ c ‖ REDO] is built by concatenating token ids: the template's
own text between assistant turns is tokenized piece by piece, and the model's generated ids are inserted as they
were sampled. The cache of an earlier stage is then an exact prefix of the later context, which is what lets
ReDuMix extend stage 1's KV cache instead of re-encoding it.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from redumix.data.prompts import Message

_PLACEHOLDER = "\x1e\x1fASSISTANT_TURN\x1f\x1e"


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[Message]) -> list[int]:
    """Token ids of a conversation rendered with the generation prompt, ready for the assistant's turn."""
    text = _render(tokenizer, messages)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def decode_text(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """The text of one sequence of ids (transformers types `decode` as `str | list[str]`, for a batch of them)."""
    text = tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
    if not isinstance(text, str):
        raise TypeError(f"{type(tokenizer).__name__}.decode gave {type(text).__name__} for one sequence, not str")
    return text


def template_pieces(tokenizer: PreTrainedTokenizerBase, messages: list[Message]) -> list[list[int]]:
    """The template's token ids around each assistant turn of `messages` (rendered with the generation prompt).

    With k assistant turns this returns k+1 pieces; the conversation's ids are
    pieces[0] + turn_1 + pieces[1] + ... + turn_k + pieces[k], where turn_i are the assistant's own ids.
    """
    return batch_template_pieces(tokenizer, [messages])[0]


def batch_template_pieces(
    tokenizer: PreTrainedTokenizerBase, conversations: Sequence[list[Message]]
) -> list[list[list[int]]]:
    """`template_pieces` of each conversation, every piece tokenized in one tokenizer call: a call costs ~0.3 ms of
    Python however few its texts, and a harvest asks for the pieces of every example at each stage."""
    texts: list[list[str]] = []
    for messages in conversations:
        masked = [dict(m, content=_PLACEHOLDER) if m["role"] == "assistant" else m for m in messages]
        parts = _render(tokenizer, masked).split(_PLACEHOLDER)
        if len(parts) != sum(m["role"] == "assistant" for m in messages) + 1:
            name = getattr(tokenizer, "name_or_path", "the tokenizer")
            raise ValueError(
                f"the chat template of {name} does not render assistant turns verbatim, so generated tokens cannot "
                "be reused as a cache prefix; use a model whose template keeps assistant content as given"
            )
        texts.append(parts)
    if not texts:
        return []
    ids = iter(tokenizer([part for parts in texts for part in parts], add_special_tokens=False)["input_ids"])
    return [[next(ids) for _ in parts] for parts in texts]


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[Message]) -> str:
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "the tokenizer")
        raise ValueError(f"{name} has no chat template; redumix needs one (use an instruct/chat checkpoint)")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

