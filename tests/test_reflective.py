"""Reflective decoding: plain decoding when the gate never fires, markers never visible, FPE equal to the forward
counter, peeks that leave the main cache as it was, and the gate/budget rules of the seed (sections 3.2-3.6)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from redumix.data.chat import prompt_ids
from redumix.data.prompts import attempt_messages
from redumix.generate.accounting import ForwardCounter
from redumix.generate.plain import generate_batch
from redumix.generate.policy import SamplingPolicy
from redumix.generate.reflective import (
    ReflectiveConfig,
    reflective_generate,
    resolve_markers,
    settle_peeks,
    step_with_peek,
    uncertainty,
)
from redumix.generate.reflective_tuning import calibrate_tau, matched_ablations
from redumix.generate.state import clone, prefill
from tests.conftest import build_tiny_model, build_tiny_tokenizer

QUESTIONS = ["What is 2 + 3?", "Tom has 7 apples and eats 2. How many are left?", "9 * 4 = ?"]
SAMPLED = SamplingPolicy(temperature=1.0, top_p=0.9, max_new_tokens=16)
GREEDY = SamplingPolicy(temperature=0.0, max_new_tokens=16)
# Reflections on every other visible token: the random model's u is near 1 everywhere, so the gate alone would fire
# once and (hysteresis) never re-arm.
OFTEN = ReflectiveConfig(
    ablation="random", random_rate=0.5, cooldown=0, reflect_length=3, budget_total=9, tau_stop=-1.0
)


def _prompts(tokenizer, questions=QUESTIONS) -> list[list[int]]:
    return [prompt_ids(tokenizer, attempt_messages(q)) for q in questions]


def _stop_ids(model, tokenizer, prompts) -> list[int]:
    # A random model rarely emits eos: stop on a token it does emit, so rows finish at different steps.
    plain = generate_batch(model, prompts, GREEDY, [0] * len(prompts), [-1], tokenizer.pad_token_id, 12)
    return [tokenizer.eos_token_id, plain[0].token_ids[5]]


def _char_tokenizer(extra_specials: list[str]) -> PreTrainedTokenizerFast:
    """Character-level chat tokenizer without the reflection markers (plus `extra_specials`)."""
    return build_tiny_tokenizer(["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", *extra_specials])


def _boost(model, ids: list[int], amount: float):
    """Make the model love `ids`: a hook adds `amount` to their logits, so only the banlist keeps them hidden."""

    def hook(module, args, output):
        output = output.clone()
        output[..., ids] += amount
        return output

    return model.lm_head.register_forward_hook(hook)


# --- the gate ---------------------------------------------------------------------------------------------------


def test_uncertainty_measures_follow_their_definitions():
    uniform = torch.log_softmax(torch.tensor([[0.0, 0.0, 0.0, 0.0, float("-inf")]]), dim=-1)
    one_hot = torch.log_softmax(torch.tensor([[0.0, float("-inf"), float("-inf")]]), dim=-1)
    assert uncertainty(uniform, "norm_entropy").item() == pytest.approx(1.0)
    assert uncertainty(uniform, "entropy").item() == pytest.approx(torch.log(torch.tensor(4.0)).item())
    assert uncertainty(uniform, "one_minus_pmax").item() == pytest.approx(0.75)
    assert uncertainty(uniform, "margin").item() == pytest.approx(1.0)
    assert uncertainty(uniform, "topk_entropy", top_k=2).item() == pytest.approx(1.0)
    for kind in ["norm_entropy", "entropy", "one_minus_pmax", "margin", "topk_entropy"]:
        assert uncertainty(one_hot, kind, top_k=2).item() == pytest.approx(0.0, abs=1e-6)


def test_gate_that_never_fires_is_plain_decoding(tiny_chat_model, tiny_llama_chat_model):
    for model, tokenizer in [tiny_chat_model, tiny_llama_chat_model]:
        prompts = _prompts(tokenizer)
        stop = _stop_ids(model, tokenizer, prompts)
        markers = resolve_markers(tokenizer, ReflectiveConfig())
        config = ReflectiveConfig(tau_high=2.0)  # every measure is at most 1
        for policy in [GREEDY, SAMPLED]:
            plain = generate_batch(
                model, prompts, policy, [5, 6, 7], stop, tokenizer.pad_token_id, banned_ids=markers.start + markers.end
            )
            ours = reflective_generate(
                model, tokenizer, prompts, policy, [5, 6, 7], stop, tokenizer.pad_token_id, config
            )
            assert [r.token_ids for r in ours] == [g.token_ids for g in plain]
            assert [r.finished for r in ours] == [g.finished for g in plain]
            assert [r.usage.fpe for r in ours] == [g.usage.fpe for g in plain]
            assert all(r.n_reflections == 0 and r.hidden_tokens == 0 for r in ours)


# --- markers ----------------------------------------------------------------------------------------------------


def test_markers_never_leak_across_1000_sampled_generations(tiny_chat_model):
    model, tokenizer = tiny_chat_model
    markers = resolve_markers(tokenizer, OFTEN)
    assert markers.source == "named" and markers.single_ids
    hash_id = tokenizer.convert_tokens_to_ids("#")
    prompts = _prompts(tokenizer, [f"{i % 17}+{i % 5}=?" for i in range(500)])
    policy = SamplingPolicy(temperature=1.0, top_p=0.95, max_new_tokens=6)
    # Half the runs: the model wants R_START and '#'; the other half it also wants R_END (and may not end on it).
    runs = [
        ([markers.start[0], hash_id], dataclasses.replace(OFTEN, reflection_only_tokens=["#"])),
        (
            [markers.start[0], markers.end[0], hash_id],
            dataclasses.replace(OFTEN, reflection_only_tokens=["#"], model_may_end=False),
        ),
    ]
    results = []
    for boosted, config in runs:
        handle = _boost(model, boosted, 30.0)
        try:
            results += reflective_generate(
                model,
                tokenizer,
                prompts,
                policy,
                list(range(500)),
                [tokenizer.eos_token_id],
                tokenizer.pad_token_id,
                config,
            )
        finally:
            handle.remove()
    assert len(results) == 1000
    forbidden = {markers.start[0], markers.end[0], hash_id}
    for r in results:
        assert not forbidden & set(r.token_ids)
        assert "<|reflect|>" not in r.text and "<|/reflect|>" not in r.text and "#" not in r.text
        assert r.audit_ids == [] and r.audit_text == ""
    assert sum(r.n_reflections for r in results) > 1000
    assert sum(r.hidden_tokens for r in results) > 1000


def test_audit_flag_shows_the_hidden_spans(tiny_chat_model):
    model, tokenizer = tiny_chat_model
    config = dataclasses.replace(OFTEN, audit=True)
    (r,) = reflective_generate(
        model, tokenizer, _prompts(tokenizer)[:1], SAMPLED, [3], [-1], tokenizer.pad_token_id, config
    )
    assert r.n_reflections > 0
    assert r.audit_text.count("<|reflect|>") == r.audit_text.count("<|/reflect|>") == r.n_reflections
    assert "<|reflect|>" not in r.text
    assert [t for t in r.audit_ids if t not in (4, 5)][: len(r.token_ids)] != []


def test_marker_fallbacks_reserved_then_stable_sequence(tiny_chat_model):
    model, _ = tiny_chat_model
    reserved = _char_tokenizer(["<|reserved_special_token_0|>", "<|reserved_special_token_1|>"])
    found = resolve_markers(reserved, ReflectiveConfig())
    assert found.source == "reserved" and found.single_ids
    plain = _char_tokenizer([])
    seq = resolve_markers(plain, ReflectiveConfig())
    assert seq.source == "sequence" and len(seq.start) > 1
    start_text = plain.decode(seq.start)
    # Multi-token markers: the model is pushed towards the marker's tokens, the banlist still keeps them out.
    model = build_tiny_model(plain, seed=3)
    prompts = _prompts(plain)
    handle = _boost(model, sorted(set(seq.start + seq.end)), 8.0)
    try:
        with ForwardCounter(model) as counter:
            results = reflective_generate(
                model, plain, prompts * 4, SAMPLED, range(12), [-1], plain.pad_token_id, OFTEN
            )
    finally:
        handle.remove()
    assert counter.tokens == sum(r.usage.fpe for r in results)
    assert sum(r.n_reflections for r in results) > 0
    for r in results:
        assert start_text not in r.text and plain.decode(seq.end) not in r.text
        assert r.marker_tokens >= r.n_reflections * len(seq.start)


# --- accounting -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ablation", ["gate", "periodic", "random", "fixed"])
@pytest.mark.parametrize("dual_path", [True, False])
def test_fpe_equals_the_forward_counter(tiny_llama_chat_model, ablation, dual_path):
    model, tokenizer = tiny_llama_chat_model
    prompts = _prompts(tokenizer)
    stop = _stop_ids(model, tokenizer, prompts)
    config = ReflectiveConfig(
        ablation=ablation,
        dual_path=dual_path,
        tau_high=0.5,
        tau_low=0.5,
        period=3,
        random_rate=0.3,
        cooldown=1,
        reflect_length=4,
        budget_total=10,
        model_may_end=False,
    )
    with ForwardCounter(model) as counter:
        results = reflective_generate(
            model, tokenizer, prompts, SAMPLED, [1, 2, 3], stop, tokenizer.pad_token_id, config
        )
    assert counter.tokens == sum(r.usage.fpe for r in results)
    assert sum(r.n_reflections for r in results) > 0
    m_s = m_e = 1
    for r, prompt in zip(results, prompts, strict=True):
        visible_fed = len(r.token_ids) - 1  # the last visible token (stop or cap) never goes through the model
        peeks = r.hidden_tokens * m_e if ablation != "fixed" else 0
        assert r.usage.fpe == len(prompt) + visible_fed + r.hidden_tokens + peeks + r.n_reflections * (
            m_s + (m_e if ablation == "fixed" else 0)
        )
        assert r.hidden_tokens <= config.budget_total
        assert all(n <= config.reflect_length for n in r.reflection_lengths)
        if ablation == "fixed":
            assert all(n == config.reflect_length for n in r.reflection_lengths[:-1])
    # Per example, on its own: the counter agrees as well.
    with ForwardCounter(model) as counter:
        (alone,) = reflective_generate(
            model, tokenizer, prompts[1:2], SAMPLED, [2], stop, tokenizer.pad_token_id, config
        )
    assert counter.tokens == alone.usage.fpe


# --- peeks ------------------------------------------------------------------------------------------------------


def _cache(state):
    return [(layer.keys, layer.values) for layer in state.cache.layers]


def test_peek_branches_leave_the_main_cache_unchanged(tiny_chat_model):
    model, tokenizer = tiny_chat_model
    pad = tokenizer.pad_token_id
    r_end = resolve_markers(tokenizer, ReflectiveConfig()).end
    main, peek = [[40], [41], [42]], [r_end, [], r_end]
    base = prefill(model, _prompts(tokenizer), pad)
    width = base.attention_mask.shape[1]
    snapshot = clone(base)

    reference, ref_logits, none = step_with_peek(model, clone(base), main, [[], [], []], pad)
    assert none is None
    sequential, seq_main, seq_peek = step_with_peek(model, clone(base), main, peek, pad, dual_path=False)
    state, main_logits, peek_logits = step_with_peek(model, base, main, peek, pad, dual_path=True)
    torch.testing.assert_close(main_logits, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(seq_main, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(peek_logits[[0, 2]], seq_peek[[0, 2]], atol=1e-5, rtol=1e-5)
    peeked = torch.tensor([True, False, True])

    # No row keeps its peek: the peek is cropped off and the cache is the main step's, bit for bit in the prefix.
    cropped = settle_peeks(clone(state), peeked, torch.tensor([False, False, False]), len(r_end))
    assert torch.equal(cropped.attention_mask, reference.attention_mask)
    assert torch.equal(cropped.lengths, reference.lengths)
    for (k, v), (k0, v0), (kr, vr) in zip(_cache(cropped), _cache(snapshot), _cache(reference), strict=True):
        assert torch.equal(k[:, :, :width], k0) and torch.equal(v[:, :, :width], v0)
        torch.testing.assert_close(k, kr, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, vr, atol=1e-5, rtol=1e-5)

    # Row 2 adopts its peek (its reflection ends): row 0's peek becomes a masked hole that changes nothing.
    kept = settle_peeks(state, peeked, torch.tensor([False, False, True]), len(r_end))
    assert kept.lengths.tolist() == (reference.lengths + torch.tensor([0, 0, 1])).tolist()
    for (k, v), (k0, v0) in zip(_cache(kept), _cache(snapshot), strict=True):
        assert torch.equal(k[:, :, :width], k0) and torch.equal(v[:, :, :width], v0)
    nxt = [[43], [44], [45]]
    _, after_hole, _ = step_with_peek(model, kept, nxt, [[], [], []], pad)
    _, after_ref, _ = step_with_peek(model, reference, nxt, [[], [], []], pad)
    torch.testing.assert_close(after_hole[:2], after_ref[:2], atol=1e-5, rtol=1e-5)


def test_dual_path_and_sequential_peeks_decode_the_same(tiny_llama_chat_model):
    model, tokenizer = tiny_llama_chat_model
    prompts = _prompts(tokenizer)
    config = ReflectiveConfig(
        tau_high=0.5,
        tau_low=0.5,
        tau_stop=0.999,
        reflect_length=5,
        budget_total=12,
        ablation="periodic",
        period=2,
        cooldown=0,
    )
    runs = [
        reflective_generate(
            model,
            tokenizer,
            prompts,
            SAMPLED,
            [7, 8, 9],
            [-1],
            tokenizer.pad_token_id,
            dataclasses.replace(config, dual_path=dual),
        )
        for dual in (True, False)
    ]
    assert sum(r.n_reflections for r in runs[0]) > 0
    for a, b in zip(*runs, strict=True):
        assert a.token_ids == b.token_ids and a.reflection_lengths == b.reflection_lengths
        assert a.usage.fpe == b.usage.fpe


# --- gate rules and budgets -------------------------------------------------------------------------------------


def test_hysteresis_cooldown_and_budgets(tiny_chat_model):
    model, tokenizer = tiny_chat_model
    prompts = _prompts(tokenizer)
    pad = tokenizer.pad_token_id
    # The random model's u is near 1: after one trigger the gate never sees u < τ_low again, so it never re-arms.
    once = reflective_generate(
        model,
        tokenizer,
        prompts,
        SAMPLED,
        [1, 2, 3],
        [-1],
        pad,
        ReflectiveConfig(tau_high=0.5, tau_low=0.5, cooldown=0),
    )
    assert [r.n_reflections for r in once] == [1, 1, 1]
    assert all(r.reflection_positions == [0] for r in once)
    assert all(len(r.delta_uncertainty) == len(r.delta_nll) == 1 for r in once)
    periodic = ReflectiveConfig(
        ablation="periodic", period=1, cooldown=3, reflect_length=2, budget_total=5, tau_stop=-1.0, model_may_end=False
    )
    for r in reflective_generate(model, tokenizer, prompts, SAMPLED, [1, 2, 3], [-1], pad, periodic):
        gaps = [b - a for a, b in zip(r.reflection_positions, r.reflection_positions[1:], strict=False)]
        assert all(g >= 3 for g in gaps)
        assert r.hidden_tokens == 5 and r.reflection_lengths == [2, 2, 1]
        assert len(r.token_ids) == SAMPLED.max_new_tokens


def test_calibration_hits_its_target_and_ablations_match_the_budget(tiny_chat_model):
    model, tokenizer = tiny_chat_model
    prompts = _prompts(tokenizer, [f"{i} + {i + 3} = ?" for i in range(8)])
    # τ_low = τ_high: the random model's u stays near 1, so any gap would stop the gate from ever re-arming.
    config = ReflectiveConfig(tau_high=0.65, tau_low=0.65, tau_stop=0.65, cooldown=1, reflect_length=3, budget_total=6)
    pad = tokenizer.pad_token_id

    def decode(settings: ReflectiveConfig) -> list:
        return reflective_generate(model, tokenizer, prompts, SAMPLED, range(8), [-1], pad, settings)

    calib = calibrate_tau(decode, config, target_rate=0.1)
    assert abs(calib.simulated_rate - 0.1) < 0.03
    assert 0 < calib.measured_rate < 0.3
    assert calib.tau_low == calib.tau_high == calib.tau_stop
    tuned = dataclasses.replace(config, tau_high=calib.tau_high, tau_low=calib.tau_low, tau_stop=calib.tau_stop)
    gated = reflective_generate(model, tokenizer, prompts, SAMPLED, range(8), [-1], tokenizer.pad_token_id, tuned)
    ablations = matched_ablations(
        tuned,
        sum(len(r.token_ids) for r in gated),
        sum(r.n_reflections for r in gated),
        sum(r.hidden_tokens for r in gated),
    )
    assert set(ablations) == {"reflective-periodic", "reflective-random", "reflective-fixed"}
    rate = sum(r.n_reflections for r in gated) / sum(len(r.token_ids) for r in gated)
    assert ablations["reflective-random"].random_rate == pytest.approx(rate)
    assert ablations["reflective-fixed"].ablation == "fixed"
