"""The reflection markers R_START and R_END, and the banlists that keep them (and reflection-only tokens) out of
the visible text: single-id markers when the tokenizer has them, else reserved tokens, else a stable sequence."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import PreTrainedTokenizerBase

from redumix.generate.reflective_config import ReflectiveConfig


@dataclass
class Markers:
    start: list[int]
    end: list[int]
    source: Literal["named", "reserved", "sequence"]

    @property
    def single_ids(self) -> bool:
        return len(self.start) == 1 and len(self.end) == 1


_FALLBACK_MARKERS = [(" ⟦reflect⟧", " ⟦/reflect⟧"), (" <<<reflect>>>", " <<</reflect>>>"), (" @@r@@", " @@/r@@")]
_STABILITY_CONTEXTS = [("", ""), ("x", "y"), ("= ", " 12"), ("\n", "\n"), ("The answer", "."), ("42", "7")]


def _single_id(tokenizer: PreTrainedTokenizerBase, text: str) -> int | None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 and ids[0] != tokenizer.unk_token_id else None


def _is_stable(tokenizer: PreTrainedTokenizerBase, text: str) -> bool:
    """The marker's ids appear unchanged whatever surrounds it (BPE merges never reach across it)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids or tokenizer.unk_token_id in ids:
        return False
    for before, after in _STABILITY_CONTEXTS:
        full = tokenizer(before + text + after, add_special_tokens=False)["input_ids"]
        if not any(full[i : i + len(ids)] == ids for i in range(len(full) - len(ids) + 1)):
            return False
    return True


def resolve_markers(tokenizer: PreTrainedTokenizerBase, config: ReflectiveConfig) -> Markers:
    """R_START/R_END: the named single-id tokens, else two reserved/unused special tokens, else a stable sequence."""
    start, end = _single_id(tokenizer, config.marker_start), _single_id(tokenizer, config.marker_end)
    if start is not None and end is not None:
        return Markers([start], [end], "named")
    template = getattr(tokenizer, "chat_template", None) or ""
    vocab = tokenizer.get_vocab()
    reserved = sorted(
        (i, t)
        for t, i in vocab.items()
        if ("reserved" in t.lower() or "unused" in t.lower()) and t not in template and _single_id(tokenizer, t) == i
    )
    if len(reserved) >= 2:
        return Markers([reserved[0][0]], [reserved[1][0]], "reserved")
    for start_text, end_text in _FALLBACK_MARKERS:
        if _is_stable(tokenizer, start_text) and _is_stable(tokenizer, end_text):
            start_ids = tokenizer(start_text, add_special_tokens=False)["input_ids"]
            end_ids = tokenizer(end_text, add_special_tokens=False)["input_ids"]
            if start_ids != end_ids[: len(start_ids)]:
                return Markers(start_ids, end_ids, "sequence")
    raise ValueError(f"{tokenizer.name_or_path}: found no usable reflection markers (no single-id or stable sequence)")


# --- banlists --------------------------------------------------------------------------------------------------------


def completing_ids(tail: Sequence[int], sequences: Sequence[Sequence[int]]) -> list[int]:
    """Ids that would complete one of `sequences` after `tail` (a single-id sequence is always banned)."""
    banned = []
    for seq in sequences:
        prefix = list(seq[:-1])
        if not prefix or list(tail[len(tail) - len(prefix) :]) == prefix:
            banned.append(seq[-1])
    return banned


def ban(logits: torch.Tensor, banned_per_row: list[list[int]]) -> torch.Tensor:
    rows = [r for r, ids in enumerate(banned_per_row) for _ in ids]
    cols = [i for ids in banned_per_row for i in ids]
    if not cols:
        return logits
    logits = logits.clone()
    logits[rows, cols] = float("-inf")
    return logits
