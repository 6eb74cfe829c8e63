"""When a reflection starts and when it ends: the uncertainty gate, the trigger points a reflection may start at,
and peek_agree's test that a confident peek agrees with the check the span just finished."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase

from redumix.data.chat import decode_text
from redumix.generate.reflective_config import GateKind
from redumix.generate.tail_text import text_ends_with

# --- the uncertainty gate --------------------------------------------------------------------------------------------


def uncertainty(logprobs: torch.Tensor, kind: GateKind = "norm_entropy", top_k: int = 10) -> torch.Tensor:
    """u per row from the log-probs of the distribution the policy samples from (−inf outside its support S)."""
    support = torch.isfinite(logprobs)
    probs = logprobs.exp()
    plogp = torch.where(support, probs * logprobs, torch.zeros_like(probs))
    size = support.sum(dim=-1)
    if kind == "entropy":
        return -plogp.sum(dim=-1)
    if kind == "norm_entropy":
        log_size = size.clamp(min=2).float().log()
        return torch.where(size > 1, -plogp.sum(dim=-1) / log_size, torch.zeros_like(log_size))
    top = torch.topk(logprobs, min(max(top_k, 2), logprobs.shape[-1]), dim=-1).values
    if kind == "one_minus_pmax":
        return 1 - top[:, 0].exp()
    if kind == "margin":
        return torch.where(size > 1, (top[:, 1] - top[:, 0]).exp(), torch.zeros_like(top[:, 0]))
    if kind == "topk_entropy":
        kept = torch.log_softmax(top, dim=-1)
        finite = torch.isfinite(kept)
        ent = -torch.where(finite, kept.exp() * kept, torch.zeros_like(kept)).sum(dim=-1)
        return ent / math.log(top.shape[-1])
    raise ValueError(f"unknown gate {kind!r}")


# --- trigger points and the peek_agree stop -------------------------------------------------------------------------


def at_trigger_point(tokenizer: PreTrainedTokenizerBase, visible: Sequence[int], triggers: Sequence[str]) -> bool:
    """Whether the visible text so far ends with one of `triggers` (always, when there are none)."""
    return not triggers or text_ends_with(tokenizer, visible, triggers, skip_special_tokens=True)


def peek_agrees(
    tokenizer: PreTrainedTokenizerBase,
    span: Sequence[int],
    peek_logits: torch.Tensor,
    next_logits: torch.Tensor,
    check_result: re.Pattern[str],
    end_id: int,
) -> bool:
    """peek_agree's test, beside the peek's confidence: does the peek begin the result of a check the span finished?

    Three things must hold, all read from logits the dual-path step already has (no extra forward pass):
    - the hidden span so far, decoded, matches `check_result` (searched; group 1 is the check's result, e.g.
      `162` in `... 150 + 12 = 162`);
    - the check is finished: the main path's most likely next hidden token (`next_logits`, the logits at the last
      hidden token's position, with R_START and stop ids banned but R_END allowed) closes the span or the line:
      it is R_END's first id `end_id`, another special token, or whitespace only. A digit would continue the
      number, and `,` or ` +` another step of the same check;
    - the peek's most likely visible token (argmax of `peek_logits`, banlist applied), decoded and stripped, is a
      non-empty prefix of the result (a tokenizer may split `162` into `16`, `2`).
    A one-digit junk span fails the first test and a half-written number or an intermediate step (`16 - 0 = 16,`)
    the second, so a peek that is sure only because it copies the span's last number (the copy trap) cannot end
    the span there. With only "not a digit" as the second test, the embedded model fell into the trap at
    intermediate steps and lost most of its accuracy (docs/measurements.md, "Reflective decoding").
    """
    match = check_result.search(decode_text(tokenizer, span))
    if match is None or not match.group(1):
        return False
    following = int(next_logits.argmax())
    closes = following == end_id or following in tokenizer.all_special_ids
    if not closes and decode_text(tokenizer, [following]).strip():
        return False
    guess = decode_text(tokenizer, [int(peek_logits.argmax())]).strip()
    return bool(guess) and match.group(1).startswith(guess)
