"""The redo's window: where x2 = [x ‖ y1 ‖ r ‖ c ‖ REDO] and the redo would not fit the model's positions, the
earliest part of the attempt y1 is cut and replaced by a short note (not a model-written summary: it costs no tokens
and keeps the later, most relevant steps). The row's context is then reopened as x ‖ note ‖ the rest of y1, and its
result's `meta` records the cut.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from redumix.data.chat import batch_template_pieces

COMPRESSION_NOTE = "(earlier steps omitted) "


def x2_prefix(x: list[int], y1: list[int], cut: int, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """x ‖ y1 as the cache holds it: a row whose y1 was cut to fit the window holds x ‖ note ‖ the rest of y1."""
    if not cut:
        return x + y1
    return x + tokenizer(COMPRESSION_NOTE, add_special_tokens=False)["input_ids"] + y1



def window_cuts(
    window: int | None,
    tokenizer: PreTrainedTokenizerBase,
    y1: list[list[int]],
    x_ids: list[list[int]],
    reflect_convs: list[list[dict]],
    reflect_pieces: list[list[int]],
    instruction: str,
    reflection_max_tokens: int,
    redo_max_tokens: int,
) -> list[int]:
    """Tokens of y1 to cut per row so that x2 (its reflection at most `reflection_max_tokens`, then the redo
    `instruction`) and the redo (at most `redo_max_tokens`) fit the window."""
    if not window:
        return [0] * len(y1)
    # Worst case of x2 plus the redo: x ‖ y1 ‖ r + REFLECT ‖ c (at its cap) ‖ REDO ‖ y (at its cap).
    redo_convs = [[*conv, {"role": "assistant", "content": ""}, {"role": "user", "content": instruction}]
                  for conv in reflect_convs]
    redo_piece = [pieces[2] for pieces in batch_template_pieces(tokenizer, redo_convs)]
    note_len = len(tokenizer(COMPRESSION_NOTE, add_special_tokens=False)["input_ids"])
    cut = []
    for x, ids, piece1, piece2 in zip(x_ids, y1, reflect_pieces, redo_piece, strict=True):
        worst = len(x) + len(ids) + len(piece1) + reflection_max_tokens + len(piece2) + redo_max_tokens
        overflow = worst - window
        # An attempt no longer than the note cannot be shortened by replacing its start with the note.
        cut.append(0 if overflow <= 0 or len(ids) <= note_len else min(len(ids), overflow + note_len))
    return cut
