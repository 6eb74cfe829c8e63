"""One step of Reflective Decoding: each row's main segment (a visible token, R_START or a hidden token) and, on top
of it, its peek (R_END), in one forward pass ("dual-path batching", seed 3.4) or two; then the peeks are settled,
adopted by the rows whose reflection they end and cropped back off the others."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicLayer

from redumix.generate.state import DecodeState, left_pad


def _run(
    model: PreTrainedModel, state: DecodeState, ids: torch.Tensor, mask: torch.Tensor, n_logits: int
) -> tuple[DecodeState, torch.Tensor]:
    """Like sampling.forward, but returns the logits of the last `n_logits` positions [B, n_logits, V]."""
    position_ids = (state.lengths[:, None] + mask.cumsum(dim=1) - 1).clamp(min=0)
    attention_mask = torch.cat([state.attention_mask, mask], dim=1)
    out = model(
        input_ids=ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=state.cache,
        use_cache=True,
        logits_to_keep=n_logits,
    )
    new = DecodeState(out.past_key_values, attention_mask, state.lengths + mask.sum(dim=1), state.last_logits)
    return new, out.logits.float()


@torch.inference_mode()
def step_with_peek(
    model: PreTrainedModel,
    state: DecodeState,
    main: Sequence[Sequence[int]],
    peek: Sequence[Sequence[int]],
    pad_id: int,
    dual_path: bool = True,
) -> tuple[DecodeState, torch.Tensor, torch.Tensor | None]:
    """Append each row's `main` segment, then its `peek` segment (R_END, or empty) on top of it.

    Returns the state with both appended (settle it with `settle_peeks`), the logits after each row's main
    segment [B, V] and, if any row peeked, the logits after its peek [B, V]. All peeks have the same length.
    """
    device = state.attention_mask.device
    main_ids, main_mask = left_pad(main, pad_id, device)
    width = max(len(p) for p in peek)
    if width == 0:
        state, logits = _run(model, state, main_ids, main_mask, 1)
        return state, logits[:, -1], None
    peek_ids = torch.full((len(peek), width), pad_id, dtype=torch.long, device=device)
    peek_mask = torch.zeros((len(peek), width), dtype=torch.long, device=device)
    for row, seq in enumerate(peek):
        if seq:
            peek_ids[row] = torch.as_tensor(seq, device=device)
            peek_mask[row] = 1
    if dual_path:
        ids, mask = torch.cat([main_ids, peek_ids], dim=1), torch.cat([main_mask, peek_mask], dim=1)
        state, logits = _run(model, state, ids, mask, width + 1)
        return state, logits[:, 0], logits[:, -1]
    state, main_logits = _run(model, state, main_ids, main_mask, 1)
    state, peek_logits = _run(model, state, peek_ids, peek_mask, 1)
    return state, main_logits[:, -1], peek_logits[:, -1]


def settle_peeks(state: DecodeState, peeked: torch.Tensor, keep: torch.Tensor, width: int) -> DecodeState:
    """Crop the last `width` positions (the peeks) back off every row except those in `keep`, which adopt theirs.

    When no row keeps its peek the columns are cut from the cache; otherwise they are masked out as holes.
    """
    drop = peeked & ~keep
    lengths = state.lengths - width * drop.long()
    if not keep.any():
        for layer in state.cache.layers:
            assert isinstance(layer, DynamicLayer)  # decoding's caches are full-attention ones (state.py)
            layer.crop(-width)
        return DecodeState(state.cache, state.attention_mask[:, :-width], lengths, state.last_logits)
    mask = state.attention_mask.clone()
    mask[drop, -width:] = 0
    return DecodeState(state.cache, mask, lengths, state.last_logits)
