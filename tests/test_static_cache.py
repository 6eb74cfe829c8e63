"""The static-cache decode path (generate/static_cache.py, static_loop.py) against the dynamic one, in float32 on the
CPU: the same ids, the stored log-probs and tails within 1e-5, the state it hands back the same to go on from."""

from __future__ import annotations

import pytest
import torch

from bench.models import build_tiny_model
from redumix.generate.mixture import mixture_loop
from redumix.generate.plain import plain_choice, sample_loop
from redumix.generate.policy import SamplingPolicy
from redumix.generate.state import extend, prefill
from redumix.generate.static_cache import static_contexts, static_extend, static_prefill
from redumix.generate.static_loop import static_loop, static_mixture_loop, static_sample_loop
from tests.conftest import one_thread

GREEDY = SamplingPolicy(max_new_tokens=24)
SAMPLED = SamplingPolicy(temperature=1.0, top_p=0.9, top_k=40, max_new_tokens=24)
TOLERANCE = 1e-5


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(7, 90, (n,), generator=g).tolist() for n in lengths]


def x_and_x2() -> tuple[list[list[int]], list[list[int]]]:
    x = prompts(0, (5, 9, 3, 12, 7))
    return x, [p + q for p, q in zip(x, prompts(1, (20, 31, 17, 25, 40)), strict=True)]


def stops_for(model, ids: list[list[int]], policy: SamplingPolicy) -> list[int]:
    """Stop ids that end some rows early and leave at least one to run to the cap. A row decodes alike whatever its
    batch holds, so it stops where its run without stops first emits a stop id: pick ids that some row first emits
    at step 3 or later and that at least one row never emits."""
    free = sample_loop(model, prefill(model, ids, 0), policy, torch.arange(len(ids)) + 5, [10**6]).generations
    runs = [g.token_ids for g in free]
    chosen: set[int] = set()
    for run in runs:
        for step in range(3, 12):
            candidate = chosen | {run[step]}
            if run[step] not in run[:step] and any(not candidate & set(other) for other in runs):
                chosen = candidate
                break
    return sorted(chosen)


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():  # tiny matrices: a second thread only waits on the first, for long on a busy host
        yield


@pytest.fixture(params=["qwen2", "llama"])
def model(request, tiny_tokenizer):
    return build_tiny_model(tiny_tokenizer, request.param, seed=5)


@pytest.mark.parametrize("policy", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_plain_decoding_equals_the_dynamic_loop_and_hands_back_the_same_state(model, policy):
    ids = prompts(2, (5, 9, 3, 12, 7))
    seeds, stop = torch.arange(5) + 5, stops_for(model, ids, policy)
    dynamic = sample_loop(model, prefill(model, ids, 0), policy, seeds, stop, keep_state=True)
    static = static_sample_loop(model, prefill(model, ids, 0), policy, seeds, stop, keep_state=True)
    lengths = [len(g.token_ids) for g in dynamic.generations]
    assert min(lengths) < policy.max_new_tokens == max(lengths)  # some rows stopped, some ran to the cap
    assert [g.token_ids for g in static.generations] == [g.token_ids for g in dynamic.generations]
    assert [(g.finished, g.cached, g.usage) for g in static.generations] == [
        (g.finished, g.cached, g.usage) for g in dynamic.generations]
    assert torch.equal(static.state.lengths, dynamic.state.lengths)
    # Either state goes on to the next turn alike: a segment, then more tokens.
    segment = prompts(3, (4, 1, 6, 2, 3))
    after = [sample_loop(model, extend(model, r.state, segment, 0), policy, seeds + 1, stop).generations
             for r in (dynamic, static)]
    assert [g.token_ids for g in after[1]] == [g.token_ids for g in after[0]]


@pytest.mark.parametrize("policy", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("lam", [0.5, 1.0, 0.0])
def test_the_mixture_equals_the_dynamic_loop_with_its_stored_log_probs_within_1e5(model, policy, lam):
    x, x2 = x_and_x2()
    seeds, stop = torch.arange(5) + 9, stops_for(model, x, policy)
    dynamic = mixture_loop(model, prefill(model, x, 0), prefill(model, x2, 0), lam, 8, policy, seeds, stop)
    static = static_mixture_loop(model, prefill(model, x, 0), prefill(model, x2, 0), lam, 8, policy, seeds, stop)
    assert len({len(gen.token_ids) for gen, *_ in dynamic}) > 1  # rows of several lengths: the dynamic loop compacts
    for (gen, ids, logprobs, tail), (gen_s, ids_s, logprobs_s, tail_s) in zip(dynamic, static, strict=True):
        assert gen_s.token_ids == gen.token_ids and gen_s.usage == gen.usage
        assert ids_s == ids
        torch.testing.assert_close(torch.tensor(logprobs_s), torch.tensor(logprobs), atol=TOLERANCE, rtol=0)
        torch.testing.assert_close(torch.tensor(tail_s), torch.tensor(tail), atol=TOLERANCE, rtol=0)


def test_prefill_and_extend_into_the_static_cache_match_the_dynamic_state(model):
    x, x2 = x_and_x2()
    segments = [p[len(q):] for p, q in zip(x2, x, strict=True)]
    segments[2] = []  # a row with nothing to add keeps its distribution
    dynamic = extend(model, prefill(model, x, 0), segments, 0)
    static = static_prefill(model, x, 0, room=64)
    static_extend(model, static, segments, 0)
    torch.testing.assert_close(static.last_logits, dynamic.last_logits, atol=TOLERANCE, rtol=0)
    assert torch.equal(static.lengths, dynamic.lengths)
    stop = stops_for(model, x, GREEDY)
    seeds = torch.arange(5)
    want = sample_loop(model, dynamic, GREEDY, seeds, stop).generations
    got = static_loop(model, static, plain_choice(GREEDY, seeds), stop, GREEDY.max_new_tokens).generations
    assert [g.token_ids for g in got] == [g.token_ids for g in want]


def test_eager_attention_takes_the_float_mask(tiny_tokenizer):
    model = build_tiny_model(tiny_tokenizer, "llama", seed=2)
    model.set_attn_implementation("eager")
    x, x2 = x_and_x2()
    seeds = torch.arange(5)
    dynamic = mixture_loop(model, prefill(model, x, 0), prefill(model, x2, 0), 0.5, 4, GREEDY, seeds, [1])
    static = static_mixture_loop(model, prefill(model, x, 0), prefill(model, x2, 0), 0.5, 4, GREEDY, seeds, [1])
    assert [r[0].token_ids for r in static] == [r[0].token_ids for r in dynamic]


def test_the_loop_stops_at_its_next_check_once_every_row_is_done(model):
    ids = prompts(4, (5, 9, 3))
    every = list(range(model.config.vocab_size))  # every id stops: each row ends on its first token
    contexts = static_contexts([prefill(model, ids, 0)], room=GREEDY.max_new_tokens)
    start = int(contexts.column)
    found = static_loop(model, contexts, plain_choice(GREEDY, torch.arange(3)), every, GREEDY.max_new_tokens)
    assert [len(g.token_ids) for g in found.generations] == [1, 1, 1]
    assert int(contexts.column) == start  # nothing fed: the check after the first token saw no row left


def test_refusals_name_what_is_wrong(model):
    state = prefill(model, prompts(4, (5, 9)), 0)
    choose = plain_choice(GREEDY, torch.arange(2))
    with pytest.raises(ValueError, match="free columns"):
        static_loop(model, static_contexts([state], room=3), choose, [1], 10)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        static_loop(model, static_contexts([state], room=9), choose, [1], 10, graphs=True)
    with pytest.raises(ValueError, match="one context per example"):
        static_loop(model, static_contexts([state, state], room=9), choose, [1], 10, 2, keep_state=True)
