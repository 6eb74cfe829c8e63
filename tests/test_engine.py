"""The engine seam (generate/engine.py): the invariant both engines keep, that a conversation grown turn by turn is
the same context as its whole token sequence read at once; the one key that picks the engine; and decoders that
need the cache token by token refusing any other engine. HfEngine against VllmEngine, row by row, is in
tests/test_vllm_harvest.py and tests/test_vllm_engine.py (they need `make vllm`)."""

from __future__ import annotations

import pytest
import torch

from redumix.generate.hf_engine import HfEngine, hf_parts
from redumix.generate.moi import MoiConfig, MoiDecoder
from redumix.generate.plain import PlainDecoder
from redumix.generate.policy import SamplingPolicy
from redumix.generate.redumix import RedumixConfig, RedumixDecoder, redo_contexts
from redumix.pipeline.config import load_config
from redumix.pipeline.resolve import ConfigError

PROMPTS = ["What is 3 + 4?", "Tom has 12 apples and eats 5. How many are left?"]
IDS = ["a", "b"]


def test_a_grown_context_is_its_whole_sequence_read_at_once(tiny_chat_model):
    """After a kept turn, the context holds the prompt and every generated token but the last (`cached`); the next
    segment feeds the rest. vLLM's engine re-sends exactly that sequence, so both count prefill alike."""
    model, tokenizer = tiny_chat_model
    engine = HfEngine(model, tokenizer)
    prompts = [tokenizer("3 + 4 =")["input_ids"], tokenizer("12 - 5 is")["input_ids"]]
    policy = SamplingPolicy(temperature=1.0, max_new_tokens=6)
    turns, grown = engine.continue_turn(engine.open(prompts), [1, 2], policy, 6, keep=True)
    assert all(g.cached == len(g.token_ids) - 1 for g in turns)
    segments = [g.token_ids[g.cached :] + tokenizer(" ok")["input_ids"] for g in turns]
    grown = engine.extend(grown, segments)
    whole = [p + g.token_ids[: g.cached] + s for p, g, s in zip(prompts, turns, segments, strict=True)]
    assert engine.lengths(grown) == [len(w) for w in whole]
    read_at_once = engine.open(whole)
    torch.testing.assert_close(grown.last_logits, read_at_once.last_logits, rtol=1e-4, atol=1e-4)


def test_a_fork_is_untouched_by_decoding_from_the_original(tiny_chat_model):
    model, tokenizer = tiny_chat_model
    engine = HfEngine(model, tokenizer)
    contexts = engine.open([tokenizer("3 + 4 =")["input_ids"]])
    fork = engine.fork(contexts)
    first, _ = engine.continue_turn(contexts, [5], SamplingPolicy(temperature=1.0, max_new_tokens=5), 5, keep=False)
    again, _ = engine.continue_turn(fork, [5], SamplingPolicy(temperature=1.0, max_new_tokens=5), 5, keep=False)
    assert first[0].token_ids == again[0].token_ids


def test_the_redo_stages_reopen_cut_rows_as_their_x2_prefix(tiny_tokenizer):
    """A window too small for x2 cuts the attempt: the row is reopened as x ‖ note ‖ the rest of y1, and the x2 the
    engine holds is the x2_ids the row records (what the on-policy teacher and the vLLM engine read)."""
    from bench.models import build_tiny_model

    model = build_tiny_model(tiny_tokenizer, max_positions=150)
    engine = HfEngine(model, tiny_tokenizer)
    config = RedumixConfig(reflection_max_tokens=12)
    stages, _, x2, _ = redo_contexts(engine, PROMPTS, IDS, config, SamplingPolicy(max_new_tokens=40), 0,
                                     lambda i, attempt: "Wrong.")
    assert any(stages.cut), "the window was meant to force a cut"
    assert engine.lengths(x2) == [len(ids) for ids in stages.x2_ids]
    torch.testing.assert_close(x2.last_logits, engine.open(stages.x2_ids).last_logits, rtol=1e-4, atol=1e-4)


def test_decoders_that_need_the_cache_refuse_another_engine(tiny_chat_model):
    assert MoiDecoder("moi", MoiConfig(), SamplingPolicy(), 0).needs_hf_engine
    assert not PlainDecoder("greedy", SamplingPolicy(), 0).needs_hf_engine
    assert not RedumixDecoder("redumix-oracle", RedumixConfig(), SamplingPolicy(), 0).needs_hf_engine

    class OtherEngine:
        name = "other"

    with pytest.raises(TypeError, match="needs the cache token by token.*'other'"):
        hf_parts(OtherEngine())  # type: ignore[arg-type]
    model, tokenizer = tiny_chat_model
    assert hf_parts(HfEngine(model, tokenizer)) == (model, tokenizer)


@pytest.mark.parametrize("old", ["harvest.engine", "eval.engine", "ladder.engine"])
def test_one_key_picks_the_engine_and_the_old_keys_point_to_it(old):
    assert load_config("tiny", ["engine=vllm"]).engine == "vllm"
    with pytest.raises(ConfigError, match=rf"unknown key '{old}' \(did you mean 'engine'\?\)"):
        load_config("tiny", [f"{old}=vllm"])


@pytest.mark.parametrize("feedback", ["verifier", "self"])
def test_the_static_cache_engine_harvests_the_dynamic_engines_rows(tiny_chat_model, feedback, monkeypatch):
    """`model.static_cache`: every stage and the redo on the static path (on CUDA, captured graphs) give the dynamic
    loop's rows in float32: the same ids, the stored p_mix within 1e-5, the same counts."""
    import redumix.generate.hf_engine as hf_engine
    from redumix.generate.redumix import redumix_generate

    static_calls = []
    for name in ("static_sample_loop", "static_mixture_loop"):
        real = getattr(hf_engine, name)
        monkeypatch.setattr(hf_engine, name, lambda *a, real=real, name=name, **k: static_calls.append(name) or
                            real(*a, **k))
    model, tokenizer = tiny_chat_model
    config = RedumixConfig(reflection_max_tokens=10, critique_max_tokens=6, feedback=feedback)
    policy = SamplingPolicy(temperature=1.0, max_new_tokens=12)
    fb = None if feedback == "self" else (lambda i, text: "Your answer is wrong.")
    rows = {static: redumix_generate(HfEngine(model, tokenizer, static_cache=static), PROMPTS, IDS, config, policy,
                                     3, fb) for static in (False, True)}
    assert set(static_calls) == {"static_sample_loop", "static_mixture_loop"}  # the static rows came from it
    for dynamic, static in zip(rows[False], rows[True], strict=True):
        assert (static.original_ids, static.reflection_ids, static.redo_token_ids, static.x2_ids) == (
            dynamic.original_ids, dynamic.reflection_ids, dynamic.redo_token_ids, dynamic.x2_ids)
        assert static.topk_ids == dynamic.topk_ids and static.usage == dynamic.usage
        torch.testing.assert_close(torch.tensor(static.topk_logprobs), torch.tensor(dynamic.topk_logprobs),
                                   rtol=0, atol=1e-5)
    plain = {static: HfEngine(model, tokenizer, static_cache=static).sample([[5, 6, 7], [8, 9]], [1, 2], policy)
             for static in (False, True)}
    assert [g.token_ids for g in plain[True]] == [g.token_ids for g in plain[False]]
    assert [g.usage for g in plain[True]] == [g.usage for g in plain[False]]
