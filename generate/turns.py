"""The turns between ReDuMix's attempt and its redo, on the attempt's growing cache: the model's own critique of its
attempt (self feedback) and the next assistant turn after a user turn (the critique, the reflection)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from redumix.data.chat import template_pieces
from redumix.data.prompts import critique_messages
from redumix.generate.accounting import Usage
from redumix.generate.loop import Generation
from redumix.generate.plain import sample_loop
from redumix.generate.policy import SamplingPolicy
from redumix.generate.state import DecodeState, clone, extend


def critiques(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    state: DecodeState,
    attempts: list[Generation],
    y1: list[list[int]],
    prompts: Sequence[str],
    y1_text: list[str],
    max_new_tokens: int,
    policy: SamplingPolicy,
    seeds: torch.Tensor,
    stop_ids: Sequence[int],
    usage: list[Usage],
) -> list[str]:
    """Self-feedback: the model critiques its own attempt, on a copy of the cache (the reflection goes on from y1)."""
    pieces = [template_pieces(tokenizer, critique_messages(p, t))[-1] for p, t in zip(prompts, y1_text, strict=True)]
    found, _ = next_turn(model, tokenizer, clone(state), attempts, y1, stop_ids, policy, seeds, pieces,
                         max_new_tokens, usage, keep_state=False)
    return [tokenizer.decode(g.content_ids(stop_ids), skip_special_tokens=True) for g in found]


def next_turn(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    state: DecodeState,
    previous: list[Generation],
    previous_ids: list[list[int]],
    stop_ids: Sequence[int],
    policy: SamplingPolicy,
    seeds: torch.Tensor,
    pieces: list[list[int]],
    max_new_tokens: int,
    usage: list[Usage],
    keep_state: bool,
    cut: Sequence[int] | None = None,
) -> tuple[list[Generation], DecodeState | None]:
    """Close the previous assistant turn, add the next user turn, and generate the next assistant turn.

    The segment fed is what of the previous turn is not yet cached, then the template's text up to the new
    assistant turn: `pieces`, per row, the last template piece of the conversation that turn answers.
    """
    segments = []
    for i, (gen, ids, piece) in enumerate(zip(previous, previous_ids, pieces, strict=True)):
        already = len(ids) if cut is not None and cut[i] else gen.cached  # a cut row's y1 was re-encoded whole
        segments.append(ids[already:] + piece)
    state = extend(model, state, segments, tokenizer.pad_token_id)
    result = sample_loop(model, state, policy, seeds, stop_ids, max_new_tokens, keep_state=keep_state)
    gens, state = result.generations, result.state
    for u, seg, g in zip(usage, segments, gens, strict=True):
        u.prefill_tokens += len(seg)
        u.fpe += len(seg) + g.usage.fpe
    return gens, state
