"""The static KV cache: fixed shapes and per-row positions, so that a decode step asks the host nothing and can be
captured as a CUDA graph (static_loop.py decodes over it).

The dynamic path (state.py) grows its caches and compacts finished rows out of the batch: right on a CPU, where a
step costs its arithmetic, but on a GPU each new shape or host sync costs, and a small model's step is its launches.
Here a batch is laid out once:

- `StaticContexts`: per model layer, keys and values of a fixed shape [R, H, L, D]; a bool mask [R, L] (a real token
  at that column); each row's length, the position id of its next token (per-row positions, as left padding needs);
  one write column that every row shares, a device tensor; and each row's next-token logits. A step writes that
  column in every row, a live row with its token and a finished one masked, then moves it on.
- `static_contexts(states, room)` lays out `DecodeState`s (x and x2 stacked, say) with `room` free columns;
  `static_prefill` and `static_extend` run prompts and segments through the model into the cache itself;
  `decode_state` hands the filled columns back to the dynamic path, to grow turn by turn.

The model sees the cache through transformers' static layer and a 4D mask built here (sdpa or eager attention):
transformers passes a 4D mask through untouched, so its mask code, and the host syncs in it, never run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer

from redumix.generate.state import DecodeState, growing_cache, left_pad


class StaticSlot(StaticLayer):
    """One layer's keys and values [R, H, L, D]: transformers' compile-friendly static layer, lent our buffers and
    written at the column every row shares (`StaticContexts.column`, a device tensor the caller moves on)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, column: torch.Tensor) -> None:
        super().__init__(max_cache_len=keys.shape[2])
        self.keys, self.values, self.column = keys, values, column
        self.buffers = (keys, values)  # the same tensors, typed: transformers' attributes may be None
        self.dtype, self.device = keys.dtype, keys.device
        self.batch_size, self.num_heads = keys.shape[:2]
        self.k_head_dim, self.v_head_dim = keys.shape[-1], values.shape[-1]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        new = key_states.shape[2]
        where = self.column if new == 1 else self.column + torch.arange(new, device=self.device)
        keys, values = self.buffers
        keys.index_copy_(2, where, key_states)
        values.index_copy_(2, where, value_states)
        return keys, values


@dataclass
class StaticContexts:
    cache: Cache  # of `slots`, as the model takes them
    slots: list[StaticSlot]
    mask: torch.Tensor  # [R, L] bool: a real token at that column
    lengths: torch.Tensor  # [R] long: real tokens per row, the position id of its next token
    column: torch.Tensor  # [1] long: the next column to write, the same for every row
    last_logits: torch.Tensor  # [R, V] float32: each row's distribution over its next token

    @property
    def batch_size(self) -> int:
        return self.mask.shape[0]

    @property
    def capacity(self) -> int:
        return self.mask.shape[1]


def _contexts(layers: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor, lengths: torch.Tensor,
              column: int, last_logits: torch.Tensor) -> StaticContexts:
    at = torch.tensor([column], dtype=torch.long, device=mask.device)
    slots = [StaticSlot(k, v, at) for k, v in layers]
    return StaticContexts(Cache(layers=list(slots)), slots, mask, lengths, at, last_logits)


def _filled(state: DecodeState) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of each of the state's layers, which must be full-attention ones."""
    found = []
    for layer in state.cache.layers:
        if not isinstance(layer, DynamicLayer) or layer.keys is None or layer.values is None:
            raise ValueError(f"a static cache takes full-attention layers, not {type(layer).__name__}")
        found.append((layer.keys, layer.values))
    return found


@torch.inference_mode()
def static_contexts(states: Sequence[DecodeState], room: int) -> StaticContexts:
    """`states` stacked along the batch in one static cache, each right-aligned to the widest (left padding), with
    `room` free columns after it: a loop of n new tokens writes n − 1 of them."""
    width = max(s.attention_mask.shape[1] for s in states)
    rows = sum(s.batch_size for s in states)
    per_state = [_filled(s) for s in states]
    mask = states[0].attention_mask.new_zeros((rows, width + room), dtype=torch.bool)
    layers = []
    for i, (k0, v0) in enumerate(per_state[0]):
        keys = k0.new_zeros((rows, k0.shape[1], width + room, k0.shape[3]))
        values = v0.new_zeros((rows, v0.shape[1], width + room, v0.shape[3]))
        layers.append((keys, values))
        start = 0
        for s, filled in zip(states, per_state, strict=True):
            k, v = filled[i]
            keys[start : start + s.batch_size, :, width - k.shape[2] : width] = k
            values[start : start + s.batch_size, :, width - v.shape[2] : width] = v
            start += s.batch_size
    start = 0
    for s in states:
        mask[start : start + s.batch_size, width - s.attention_mask.shape[1] : width] = s.attention_mask.bool()
        start += s.batch_size
    lengths = torch.cat([s.lengths for s in states])
    return _contexts(layers, mask, lengths, width, torch.cat([s.last_logits for s in states]).float())


def empty_contexts(model: PreTrainedModel, rows: int, capacity: int) -> StaticContexts:
    """A static cache of `capacity` columns for `rows` rows of `model`, holding nothing yet."""
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    like = next(model.parameters())
    shape = (rows, heads, capacity, head_dim)
    layers = [(like.new_zeros(shape), like.new_zeros(shape)) for _ in range(config.num_hidden_layers)]
    mask = torch.zeros((rows, capacity), dtype=torch.bool, device=like.device)
    lengths = torch.zeros(rows, dtype=torch.long, device=like.device)
    logits = torch.zeros((rows, config.vocab_size), dtype=torch.float32, device=like.device)
    return _contexts(layers, mask, lengths, 0, logits)


def attention_mask(model: PreTrainedModel, allowed: torch.Tensor) -> torch.Tensor:
    """The 4D mask [R, 1, T, L] that the model's attention takes as it is, from where each query may look (bool).
    transformers returns a 4D mask untouched, so building it here skips its mask code and the host syncs in it."""
    kind = model.config._attn_implementation
    if kind == "sdpa":
        return allowed
    if kind == "eager":
        dtype = next(model.parameters()).dtype
        return torch.zeros((), dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
    raise ValueError(f"the static cache builds masks for sdpa or eager attention, not {kind!r}")


@torch.inference_mode()
def static_forward(model: PreTrainedModel, contexts: StaticContexts, ids: torch.Tensor,
                   new_mask: torch.Tensor) -> None:
    """Run T new positions a row ([R, T] ids, new_mask True where real) into columns [column, column + T), in place;
    a row whose last new position is padding keeps its distribution."""
    new = ids.shape[1]
    columns = contexts.column if new == 1 else contexts.column + torch.arange(new, device=ids.device)
    contexts.mask.index_copy_(1, columns, new_mask)
    allowed = contexts.mask[:, None, None, :]
    if new > 1:  # causal inside the segment; a single new position sees every filled column
        reach = torch.arange(contexts.capacity, device=ids.device)[None, :] <= columns[:, None]
        allowed = allowed & reach[None, None]
    position_ids = (contexts.lengths[:, None] + new_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=attention_mask(model, allowed), position_ids=position_ids,
                past_key_values=contexts.cache, use_cache=True, logits_to_keep=1)
    logits = out.logits[:, -1].float()
    contexts.last_logits.copy_(torch.where(new_mask[:, -1:], logits, contexts.last_logits))
    contexts.lengths.add_(new_mask.sum(dim=1))
    contexts.column.add_(new)


def static_prefill(model: PreTrainedModel, prompts: Sequence[Sequence[int]], pad_id: int, room: int) -> StaticContexts:
    """The prompts, left-padded, run into a fresh static cache with `room` columns to spare."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("cannot decode from an empty prompt")
    ids, mask = left_pad(prompts, pad_id, model.device)
    contexts = empty_contexts(model, len(prompts), ids.shape[1] + room)
    static_forward(model, contexts, ids, mask.bool())
    return contexts


def static_extend(model: PreTrainedModel, contexts: StaticContexts, segments: Sequence[Sequence[int]],
                  pad_id: int) -> None:
    """Append a segment to every row (left-padded inside the segment; a row's may be empty), in place."""
    if not any(segments):
        return
    ids, mask = left_pad(segments, pad_id, contexts.mask.device)
    if int(contexts.column) + ids.shape[1] > contexts.capacity:
        raise ValueError(f"the static cache has {contexts.capacity} columns; the segment needs {ids.shape[1]} more "
                         f"after {int(contexts.column)}")
    static_forward(model, contexts, ids, mask.bool())


@torch.inference_mode()
def decode_state(contexts: StaticContexts) -> DecodeState:
    """The filled columns as the dynamic path's `DecodeState` (copied), to grow turn by turn from there."""
    filled = int(contexts.column)
    layers = [(keys[:, :, :filled], values[:, :, :filled]) for keys, values in (s.buffers for s in contexts.slots)]
    return DecodeState(growing_cache(layers), contexts.mask[:, :filled].long(), contexts.lengths.clone(),
                       contexts.last_logits.clone())
