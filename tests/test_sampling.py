"""The decode primitives' KV cache: in-place appends match a fresh prefill, and batch plumbing round-trips."""

import torch

from redumix.generate.state import GrowingLayer, append_tokens, clone, extend, merge, prefill, select

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
GROWN = [[20, 21, 22, 23, 24, 25, 26, 27, 28, 29], [30], [31, 32, 33]]


def _kv(state):
    return [(layer.keys, layer.values) for layer in state.cache.layers]


def _assert_same_state(a, b) -> None:
    assert torch.equal(a.attention_mask, b.attention_mask)
    assert torch.equal(a.lengths, b.lengths)
    assert torch.equal(a.last_logits, b.last_logits)
    for (ka, va), (kb, vb) in zip(_kv(a), _kv(b), strict=True):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_appending_in_place_matches_a_fresh_prefill(tiny_chat_model):
    model, tok = tiny_chat_model
    pad = tok.pad_token_id
    state = prefill(model, PROMPTS, pad)
    assert all(isinstance(layer, GrowingLayer) for layer in state.cache.layers)
    buffers = [layer.key_buffer for layer in state.cache.layers]
    for step in range(12):  # past the first buffer's capacity (twice the prompt width), so it grows once
        tokens = torch.tensor([40 + step, 41 + step, 42 + step])
        state = append_tokens(model, state, tokens, torch.ones(3, dtype=torch.bool))
    state = extend(model, state, GROWN, pad)  # a multi-token segment of different lengths, left-padded
    assert any(layer.key_buffer is not old for layer, old in zip(state.cache.layers, buffers, strict=True))
    for layer in state.cache.layers:
        assert layer.keys.shape[2] == state.attention_mask.shape[1]  # views of the filled part only

    # The same rows, each prefilled alone from its full token sequence (no padding anywhere).
    for row, (prompt, grown) in enumerate(zip(PROMPTS, GROWN, strict=True)):
        ids = prompt + [40 + step + row for step in range(12)] + grown
        alone = prefill(model, [ids], pad)
        torch.testing.assert_close(state.last_logits[row], alone.last_logits[0], atol=1e-5, rtol=1e-5)


def test_crop_then_append_reuses_the_buffer(tiny_chat_model):
    model, tok = tiny_chat_model
    pad = tok.pad_token_id
    state = extend(model, prefill(model, PROMPTS, pad), [[50, 51], [52, 53], [54, 55]], pad)
    reference = extend(model, prefill(model, PROMPTS, pad), [[60], [61], [62]], pad)
    buffers = [layer.key_buffer for layer in state.cache.layers]
    state.cache.crop(-2)  # what reflective decoding does to drop a peek
    state.attention_mask, state.lengths = state.attention_mask[:, :-2], state.lengths - 2
    state = extend(model, state, [[60], [61], [62]], pad)
    assert all(layer.key_buffer is old for layer, old in zip(state.cache.layers, buffers, strict=True))
    torch.testing.assert_close(state.last_logits, reference.last_logits, atol=1e-5, rtol=1e-5)
    for (k, v), (kr, vr) in zip(_kv(state), _kv(reference), strict=True):
        torch.testing.assert_close(k, kr, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, vr, atol=1e-5, rtol=1e-5)


def test_select_merge_clone_round_trip(tiny_chat_model):
    model, tok = tiny_chat_model
    pad = tok.pad_token_id
    state = extend(model, prefill(model, PROMPTS, pad), GROWN, pad)

    copy = clone(state)
    _assert_same_state(copy, state)
    for (k, _), (kc, _) in zip(_kv(state), _kv(copy), strict=True):
        assert k.data_ptr() != kc.data_ptr()  # a real copy: appending to one leaves the other alone

    parts = [select(state, [0]), select(state, [1, 2])]
    _assert_same_state(merge(parts), state)

    # Decoding on from a rebuilt state equals decoding on from the original.
    tokens, active = torch.tensor([70, 71, 72]), torch.ones(3, dtype=torch.bool)
    rebuilt = append_tokens(model, merge(parts), tokens, active)
    original = append_tokens(model, copy, tokens, active)
    _assert_same_state(rebuilt, original)
    # select trims all-padding columns on the left (holes inside a row stay); the rows' logits stay put.
    trimmed = select(rebuilt, [1])
    assert trimmed.attention_mask[0, 0] == 1 and int(trimmed.attention_mask.sum()) == int(rebuilt.lengths[1])
    assert all(layer.keys.shape[2] == trimmed.attention_mask.shape[1] for layer in trimmed.cache.layers)
    torch.testing.assert_close(trimmed.last_logits, original.last_logits[1:2])
