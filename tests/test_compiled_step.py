"""The compiled one-token step (`model.compile_decoding`) decodes what the eager forward decodes.

Compiling even a tiny model is slow the first time, so the tests share two compiled models.
"""

from __future__ import annotations

import copy

import pytest
import torch

from bench.models import build_tiny_model
from redumix.generate.loop import Choice, decode_prompts
from redumix.generate.model_io import ModelConfig, load_model
from redumix.generate.state import (
    COMPILED_FORWARD,
    SPAN_WINDOW,
    append_tokens,
    extend,
    prefill,
    use_compiled_decoding,
)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def eager_and_compiled(request, tiny_tokenizer):
    eager = build_tiny_model(tiny_tokenizer, request.param, seed=3)
    compiled = copy.deepcopy(eager)
    use_compiled_decoding(compiled)
    return eager, compiled


def test_steps_match_eager_across_holes_idle_rows_and_growing_spans(eager_and_compiled, tiny_tokenizer):
    eager, compiled = eager_and_compiled
    pad = tiny_tokenizer.pad_token_id
    prompts = [[7, 8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18]]
    segments = [[20], [21, 22, 23, 24], []]  # ragged: holes in the middle of rows 0 and 2
    states = [extend(model, prefill(model, prompts, pad), segments, pad) for model in (eager, compiled)]
    # Past two span windows and the growing buffers' first doublings.
    steps = 2 * SPAN_WINDOW + 5
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        tokens = torch.randint(7, 60, (3,), generator=generator)
        active = torch.tensor([True, step % 3 != 1, step % 5 != 0])
        states = [append_tokens(model, state, tokens, active) 
                  for model, state in zip((eager, compiled), states, strict=True)]
        torch.testing.assert_close(states[1].last_logits, states[0].last_logits, atol=2e-5, rtol=1e-5)
    want, got = states
    assert torch.equal(got.attention_mask, want.attention_mask)
    assert torch.equal(got.lengths, want.lengths)
    for (k0, v0), (k1, v1) in zip(
        [(layer.keys, layer.values) for layer in want.cache.layers],
        [(layer.keys, layer.values) for layer in got.cache.layers],
        strict=True,
    ):
        torch.testing.assert_close(k1, k0, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(v1, v0, atol=2e-5, rtol=1e-5)


def test_greedy_loop_with_compaction_down_to_one_row_matches_eager(eager_and_compiled, tiny_tokenizer):
    eager, compiled = eager_and_compiled
    pad = tiny_tokenizer.pad_token_id
    prompts = [[7 + i, 30, 31 + i, 40][: 2 + i % 3] for i in range(6)]

    def greedy(logits: torch.Tensor, live: torch.Tensor, step: int) -> Choice:
        return Choice(logits.argmax(-1))

    free = decode_prompts(eager, prompts, greedy, [pad], pad, 24)
    # Stop each row on the token it emits at a different step, so rows finish one by one and the loop compacts the
    # batch down to a single row.
    stops = sorted({gen.token_ids[3 + 3 * i] for i, gen in enumerate(free)})
    want = decode_prompts(eager, prompts, greedy, stops, pad, 24)
    got = decode_prompts(compiled, prompts, greedy, stops, pad, 24)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert len({len(w.token_ids) for w in want}) > 2, "the rows should finish at different steps"


def test_the_recipe_key_turns_it_on(tiny_model_dir):
    plain, _ = load_model(tiny_model_dir)
    compiled, _ = load_model(tiny_model_dir, ModelConfig(compile_decoding=True))
    assert not hasattr(plain, COMPILED_FORWARD)
    assert hasattr(compiled, COMPILED_FORWARD)


def test_the_bench_counts_compiled_steps_as_forwards(eager_and_compiled, tiny_tokenizer):
    from bench.harvest_vs_hf import Forwards, counting

    pad = tiny_tokenizer.pad_token_id
    prompts = [[7, 8, 9], [10, 11]]

    def greedy(logits: torch.Tensor, live: torch.Tensor, step: int) -> Choice:
        return Choice(logits.argmax(-1))

    counts = []
    for model in eager_and_compiled:
        counts.append(Forwards())
        with counting(model, counts[-1]):
            decode_prompts(model, prompts, greedy, [pad], pad, 5)
    assert counts[0] == counts[1] == Forwards(calls=5, positions=3 * 2 + 4 * 2)
