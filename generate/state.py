"""The decode state every decoder builds on: a batch of contexts with its KV cache, and the operations on it.

A `DecodeState` is a batch of contexts: a KV cache, the attention mask over it (1 = real token, 0 = padding,
anywhere in the row) and each row's length, which is the position id of its next token. Contexts of different
lengths share a batch through left padding; a later segment of different length per row (a feedback turn, say)
is left-padded inside the segment, so holes in the middle of a row are normal and masked.

The KV cache is a `DynamicCache` of `GrowingLayer`s: transformers' `DynamicLayer` appends with `torch.cat`, which
copies the whole cache every token; a growing layer writes the new positions into spare room instead.

`use_compiled_decoding(model)` makes every one-token step (the decode loops' hot path) run through a
`torch.compile`d forward instead; prefills and multi-token segments stay eager. See `_compiled_step`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer

COMPILED_FORWARD = "redumix_compiled_forward"  # the model attribute `use_compiled_decoding` sets
SPAN_WINDOW = 32  # the compiled step attends over the cache in whole windows of this many positions


@dataclass
class DecodeState:
    cache: DynamicCache
    attention_mask: torch.Tensor  # [B, L] long
    lengths: torch.Tensor  # [B] long, real tokens per row
    last_logits: torch.Tensor  # [B, V] float32, the distribution over each row's next token

    @property
    def batch_size(self) -> int:
        return self.attention_mask.shape[0]


# --- batch plumbing -----------------------------------------------------------------------------------------------


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        if seq:
            ids[row, width - len(seq) :] = torch.as_tensor(seq, dtype=torch.long)
            mask[row, width - len(seq) :] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def forward(
    model: PreTrainedModel,
    state: DecodeState | None,
    new_mask: torch.Tensor,
    input_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
) -> DecodeState:
    """Run new positions [B, T] through the model on top of `state` (None = empty contexts)."""
    batch = new_mask.shape[0]
    if state is None:
        past_mask = new_mask.new_zeros((batch, 0))
        lengths = new_mask.new_zeros(batch)
        cache = growing_cache()
    else:
        past_mask, lengths, cache = state.attention_mask, state.lengths, state.cache
    position_ids = (lengths[:, None] + new_mask.cumsum(dim=1) - 1).clamp(min=0)
    attention_mask = torch.cat([past_mask, new_mask], dim=1)
    if state is not None and new_mask.shape[1] == 1 and hasattr(model, COMPILED_FORWARD):
        logits = _compiled_step(model, cache, attention_mask, position_ids, input_ids, inputs_embeds)
    else:
        out = model(
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=step_mask(model, attention_mask) if new_mask.shape[1] == 1 else attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1]
    logits = logits.float()
    if state is not None and not bool(new_mask[:, -1].all()):
        # A row with an empty segment keeps the distribution it had.
        logits = torch.where(new_mask[:, -1:].bool(), logits, state.last_logits)
    return DecodeState(cache, attention_mask, lengths + new_mask.sum(dim=1), logits)


def step_mask(model: PreTrainedModel, attention_mask: torch.Tensor) -> torch.Tensor:
    """The mask of a one-token step. With padding, under SDPA and full attention, the 4D bool mask transformers would
    build ([B, 1, 1, L]: the new position sees every real token), made here in one op, since transformers passes a
    4D mask through and its mask code costs a decode step of a small model several percent (docs/benchmarks.md).
    Without padding the 2D mask, which transformers drops for SDPA's maskless call: the same inputs either way."""
    if model.config._attn_implementation != "sdpa" or not _full_attention(model.config) or bool(attention_mask.all()):
        return attention_mask
    return attention_mask.bool()[:, None, None, :]


def _full_attention(config) -> bool:
    kinds = getattr(config, "layer_types", None)
    return all(k == "full_attention" for k in kinds) if kinds else getattr(config, "sliding_window", None) is None


def prefill(model: PreTrainedModel, prompts: Sequence[Sequence[int]], pad_id: int) -> DecodeState:
    if any(len(p) == 0 for p in prompts):
        raise ValueError("cannot decode from an empty prompt")
    ids, mask = left_pad(prompts, pad_id, model.device)
    return forward(model, None, mask, input_ids=ids)


def extend(model: PreTrainedModel, state: DecodeState, segments: Sequence[Sequence[int]], pad_id: int) -> DecodeState:
    """Append a segment of tokens to every row (segments may differ in length, and may be empty)."""
    ids, mask = left_pad(segments, pad_id, model.device)
    return forward(model, state, mask, input_ids=ids)


def append_tokens(
    model: PreTrainedModel, state: DecodeState, tokens: torch.Tensor, active: torch.Tensor
) -> DecodeState:
    """Append one token per row; rows where `active` is False get a masked pad position."""
    return forward(model, state, active.long()[:, None], input_ids=tokens[:, None])


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer whose `keys`/`values` are views of the filled prefix of a larger buffer.

    `update` writes the new positions in place and doubles the buffer when it is full, so appending a token costs
    the token, not the cache. Code that reassigns `keys`/`values` (`crop`, `batch_select_indices`, a caller) keeps
    working: when they are no longer a prefix view of the buffer, the next `update` copies them into a new one.
    """

    def __init__(self) -> None:
        super().__init__()
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None
        self.filled: tuple[torch.Tensor, torch.Tensor] | None = None  # the views `fill_to` made, while still in place

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        # A decode step's usual case, checked by identity: keys and values are still the views fill_to made, with room
        # after them. Else `reserve` checks what they are and copies where it must.
        filled, buffer = self.filled, self.key_buffer
        if not (filled and filled[0] is self.keys and filled[1] is self.values and buffer is not None
                and end <= buffer.shape[2]):
            self.reserve(end, key_states, value_states)
        self.key_buffer[:, :, length:end] = key_states
        self.value_buffer[:, :, length:end] = value_states
        self.fill_to(end)
        return self.keys, self.values

    def reserve(self, end: int, new_keys: torch.Tensor | None = None, new_values: torch.Tensor | None = None) -> None:
        """Make the buffers hold positions up to `end` (shaped like `new_keys`/`new_values`, by default the filled
        ones, but for length)."""
        length = self.get_seq_length()
        keys, values = self.keys, self.values
        assert keys is not None and values is not None  # set by lazy_initialization, before any reserve
        if not (_is_prefix_of(keys, self.key_buffer, end) and _is_prefix_of(values, self.value_buffer, end)):
            self.key_buffer = _regrow(keys, keys if new_keys is None else new_keys, length, end)
            self.value_buffer = _regrow(values, values if new_values is None else new_values, length, end)

    def fill_to(self, end: int) -> None:
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        self.filled = (self.keys, self.values)


def _is_prefix_of(filled: torch.Tensor, buffer: torch.Tensor | None, end: int) -> bool:
    """Whether `filled` is buffer[:, :, :n] for some n, and the buffer has room up to `end`."""
    return (
        buffer is not None
        and buffer.shape[2] >= end
        and filled.dim() == 4
        and filled.data_ptr() == buffer.data_ptr()
        and filled.stride() == buffer.stride()
        and filled.shape[:2] == buffer.shape[:2]
        and filled.shape[3] == buffer.shape[3]
    )


def _regrow(filled: torch.Tensor, new: torch.Tensor, length: int, end: int) -> torch.Tensor:
    """A buffer of twice the needed length holding the first `length` positions of `filled`, zeros after them.

    Zeros, not `new_empty`: the compiled step attends over a span of the buffer past the filled width, masked, and
    uninitialised memory can hold NaN, which a zero attention weight does not cancel (0 · NaN = NaN).
    """
    batch, heads, _, dim = new.shape
    buffer = new.new_empty((batch, heads, 2 * end, dim))
    if length:
        buffer[:, :, :length] = filled
    buffer[:, :, length:].zero_()  # only past the copy: zeroing all of it first would write the prefix twice
    return buffer


def growing_cache(layers: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> DynamicCache:
    """A cache of growing layers, holding copies of `layers` ((keys, values) per model layer) if any."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer  # layers the model adds lazily (an empty cache) grow too
    for keys, values in layers:
        layer = GrowingLayer()
        layer.update(keys, values)
        cache.layers.append(layer)
    return cache


def full_attention_layers(cache: Cache) -> list[DynamicLayer]:
    """The cache's layers, each a full-attention one (transformers' or a growing one), or an error naming the kind."""
    layers = []
    for layer in cache.layers:
        if type(layer) not in (DynamicLayer, GrowingLayer) or not isinstance(layer, DynamicLayer):
            raise ValueError(f"decoding needs full-attention caches, got {type(layer).__name__}")
        layers.append(layer)
    return layers


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in full_attention_layers(cache)]


@torch.inference_mode()  # like `forward`: all cache tensors are inference tensors, one kind for the compiled step
def select(state: DecodeState, rows: torch.Tensor | list[int]) -> DecodeState:
    """A new state holding `rows` of `state`, with all-padding columns on the left trimmed away."""
    rows = torch.as_tensor(rows, dtype=torch.long, device=state.attention_mask.device)
    mask = state.attention_mask.index_select(0, rows)
    first = int((mask.sum(dim=0) > 0).nonzero()[0]) if mask.any() else mask.shape[1]
    layers = [
        (k[:, :, first:].index_select(0, rows), v[:, :, first:].index_select(0, rows)) for k, v in _layers(state.cache)
    ]
    cache = growing_cache(layers)
    return DecodeState(
        cache, mask[:, first:], state.lengths.index_select(0, rows), state.last_logits.index_select(0, rows)
    )


@torch.inference_mode()  # like `forward`: all cache tensors are inference tensors, one kind for the compiled step
def merge(states: Sequence[DecodeState], room: int | None = None) -> DecodeState:
    """Stack states along the batch, left-padding the shorter ones (cache and mask) to the longest. The new buffers
    have `room` free positions (default: as many as filled), so a caller that knows how far it decodes allocates
    only that."""
    width = max(s.attention_mask.shape[1] for s in states)

    def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
        missing = width - t.shape[dim]
        if missing == 0:
            return t
        shape = list(t.shape)
        shape[dim] = missing
        return torch.cat([t.new_zeros(shape), t], dim=dim)

    per_state = [_layers(s.cache) for s in states]
    cache = growing_cache()
    cache.layers = [_stacked_layer([ls[i] for ls in per_state], width, width if room is None else room)
                    for i in range(len(per_state[0]))]
    return DecodeState(
        cache,
        torch.cat([pad(s.attention_mask, 1) for s in states]),
        torch.cat([s.lengths for s in states]),
        torch.cat([s.last_logits for s in states]),
    )


def _stacked_layer(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], width: int, room: int) -> GrowingLayer:
    """A growing layer holding `parts` ((keys, values) each) stacked along the batch, each right-aligned to `width`:
    written straight into the new buffers, instead of padded and concatenated first and then copied in."""
    keys, values = parts[0]
    layer = GrowingLayer()
    layer.lazy_initialization(keys, values)
    rows = sum(k.shape[0] for k, _ in parts)
    layer.key_buffer = keys.new_zeros((rows, keys.shape[1], width + room, keys.shape[3]))
    layer.value_buffer = values.new_zeros((rows, values.shape[1], width + room, values.shape[3]))
    first = 0
    for k, v in parts:
        layer.key_buffer[first : first + k.shape[0], :, width - k.shape[2] : width] = k
        layer.value_buffer[first : first + v.shape[0], :, width - v.shape[2] : width] = v
        first += k.shape[0]
    layer.fill_to(width)
    return layer


@torch.inference_mode()  # like `forward`: all cache tensors are inference tensors, one kind for the compiled step
def clone(state: DecodeState) -> DecodeState:
    return DecodeState(
        growing_cache(_layers(state.cache)),  # growing_cache copies
        state.attention_mask.clone(),
        state.lengths.clone(),
        state.last_logits.clone(),
    )


# --- the compiled one-token step --------------------------------------------------------------------------------


def use_compiled_decoding(model: PreTrainedModel) -> None:
    """From now on, every one-token step on `model` runs through `torch.compile(model.forward)`.

    A decode step of a small model is mostly the per-op cost of transformers' eager forward, which compiling fuses
    away, so a step at the embedded shape gets faster (docs/measurements.md, "Compiled decoding"). The price is a
    one-off compile, far longer for a 30-layer model, once for a batch of 1 and once for any larger batch (the batch
    and cache lengths are dynamic, so compaction and a growing cache do not recompile).
    """
    setattr(model, COMPILED_FORWARD, torch.compile(model.forward, dynamic=True))


class _BufferSlot(StaticLayer):
    """transformers' compile-friendly static cache layer, lent the first `span` positions of a growing layer's
    buffers: it writes the new position at column `width` in place and returns the span, whose tail past `width`
    the mask hides."""

    def __init__(self, layer: GrowingLayer, width: int, span: int) -> None:
        super().__init__(max_cache_len=span)
        self.keys, self.values = layer.key_buffer[:, :, :span], layer.value_buffer[:, :, :span]
        self.dtype, self.device = self.keys.dtype, self.keys.device
        self.batch_size, self.num_heads = self.keys.shape[:2]
        self.k_head_dim, self.v_head_dim = self.keys.shape[-1], self.values.shape[-1]
        # One tensor per layer: `update` advances it in place.
        self.cumulative_length = torch.tensor(width, device=self.device)
        self.is_initialized = True


def _compiled_step(
    model: PreTrainedModel,
    cache: DynamicCache,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
) -> torch.Tensor:
    """The next-token logits [B, V] of one new position per row (the last column of `attention_mask`), through the
    compiled forward; `cache` takes the new position as `forward`'s eager call would. The model sees the cache as
    static layers over a window-rounded span of the growing buffers, with a mask as wide, so the shapes change only
    when the batch does or the span grows; both are dynamic in the compiled graph."""
    layers = [layer for layer in cache.layers if isinstance(layer, GrowingLayer)]
    if len(layers) != len(cache.layers):
        raise ValueError("the compiled decode step needs the growing cache that prefill builds")
    width = attention_mask.shape[1] - 1  # the new position's column
    # Attend over the filled width rounded up to a whole window, not the whole buffer (up to twice the width): the
    # shapes then change once every SPAN_WINDOW steps, which a dynamic graph takes without recompiling.
    span = -(-(width + 1) // SPAN_WINDOW) * SPAN_WINDOW
    for layer in layers:
        # Room past the span as well, so the model always gets a strided view and one graph serves every step (a
        # view that happened to be the whole buffer would be contiguous and compile a second graph).
        layer.reserve(span + 1)
    unfilled = attention_mask.new_zeros(attention_mask.shape[0], span - width - 1)
    out = getattr(model, COMPILED_FORWARD)(
        input_ids=input_ids,
        inputs_embeds=inputs_embeds,
        attention_mask=torch.cat([attention_mask, unfilled], dim=1),
        position_ids=position_ids,
        past_key_values=Cache(layers=[_BufferSlot(layer, width, span) for layer in layers]),
        use_cache=True,
        logits_to_keep=1,
    )
    for layer in layers:
        layer.fill_to(width + 1)
    return out.logits[:, -1]
