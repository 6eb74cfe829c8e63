"""Reflective decoding: plain decoding when the gate never fires, markers never visible, FPE equal to the forward
counter for every stop rule, peeks that leave the main cache as it was, the gate/budget rules of the seed (sections
3.2-3.6), the stop rules (end_marker, peek, peek_agree) and trigger points, and the tuning that chooses them."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from bench.models import build_tiny_model, build_tiny_tokenizer
from redumix.data.chat import prompt_ids
from redumix.data.prompts import attempt_messages
from redumix.generate.accounting import ForwardCounter, Usage
from redumix.generate.plain import generate_batch
from redumix.generate.policy import SamplingPolicy
from redumix.generate.reflective_config import STOP_RULES, ReflectiveConfig
from redumix.generate.reflective_loop import ReflectiveResult, reflective_generate
from redumix.generate.reflective_markers import resolve_markers
from redumix.generate.reflective_rules import at_trigger_point, peek_agrees, uncertainty
from redumix.generate.reflective_step import settle_peeks, step_with_peek
from redumix.generate.reflective_tuning import calibrate_tau, choose_stop, matched_ablations
from redumix.generate.state import clone, prefill
from redumix.pipeline.config import load_config
from redumix.pipeline.run import RunDir
from redumix.pipeline.studies import calibrate
from tests.conftest import one_thread

ROOT = Path(__file__).resolve().parents[1]

QUESTIONS = ["What is 2 + 3?", "Tom has 7 apples and eats 2. How many are left?", "9 * 4 = ?"]
SAMPLED = SamplingPolicy(temperature=1.0, top_p=0.9, max_new_tokens=16)
GREEDY = SamplingPolicy(temperature=0.0, max_new_tokens=16)
# Reflections on every other visible token: the random model's u is near 1 everywhere, so the gate alone would fire
# once and (hysteresis) never re-arm. Sampled hidden tokens and the peek stop that never fires (τ_stop < 0), so
# that reflections end at their length or on a sampled R_END.
OFTEN = ReflectiveConfig(
    ablation="random", random_rate=0.5, cooldown=0, reflect_length=3, budget_total=9, tau_stop=-1.0, stop="peek",
    reflect_temperature=1.0,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run on one thread: a second only adds sync cost, which dwarfs a tiny forward on busy shared cores
    (docs/measurements.md, "Tests")."""
    with one_thread():
        yield


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
    hash_id, eq_id = tokenizer.convert_tokens_to_ids("#"), tokenizer.convert_tokens_to_ids("=")
    start, end = markers.start[0], markers.end[0]
    prompts = _prompts(tokenizer, [f"{i % 17}+{i % 5}=?" for i in range(250)])
    policy = SamplingPolicy(temperature=1.0, top_p=0.95, max_new_tokens=6)
    hidden_only = dataclasses.replace(OFTEN, reflection_only_tokens=["#"])
    # 4 x 250 runs. The model wants R_START and '#' (peek stop); it also wants R_END but may not end on it; it
    # wants R_END a little and '=' (visible) a lot, with each stop rule that needs it: end_marker, and peek_agree with
    # a peek that is always confident, both only at the trigger point "==" (two tokens).
    at_points = dataclasses.replace(hidden_only, trigger_after=["=="], tau_stop=1.0)
    runs = [
        ({start: 30.0, hash_id: 30.0}, hidden_only),
        ({start: 30.0, end: 30.0, hash_id: 30.0}, dataclasses.replace(hidden_only, model_may_end=False)),
        ({start: 30.0, end: 3.0, hash_id: 2.0, eq_id: 5.0}, dataclasses.replace(at_points, stop="end_marker")),
        ({start: 30.0, end: 3.0, hash_id: 2.0, eq_id: 5.0}, dataclasses.replace(at_points, stop="peek_agree")),
    ]
    results = []
    for boosted, config in runs:
        handles = [_boost(model, [token], amount) for token, amount in boosted.items()]
        try:
            batch = reflective_generate(
                model, tokenizer, prompts, policy, list(range(250)), [tokenizer.eos_token_id], tokenizer.pad_token_id,
                config,
            )
        finally:
            for handle in handles:
                handle.remove()
        assert sum(r.n_reflections for r in batch) > 150 and sum(r.hidden_tokens for r in batch) > 150
        if config.trigger_after:
            texts = [tokenizer.decode(r.token_ids[:p], skip_special_tokens=True) for r in batch for p in
                     r.reflection_positions]
            assert all(text.endswith("==") for text in texts)
        results += batch
    assert len(results) == 1000
    forbidden = {start, end, hash_id}
    for r in results:
        assert not forbidden & set(r.token_ids)
        assert "<|reflect|>" not in r.text and "<|/reflect|>" not in r.text and "#" not in r.text
        assert r.audit_ids == [] and r.audit_text == ""
    reasons = Counter(reason for r in results[500:] for reason in r.end_reasons)
    assert reasons["model_end"] > 0 and reasons["length"] > 0


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


TRIGGERS = list("aeiou0123456789 ")  # common enough in the random model's text to trigger often


@pytest.mark.parametrize("ablation", ["gate", "periodic", "random", "fixed"])
@pytest.mark.parametrize("stop", STOP_RULES)
@pytest.mark.parametrize("dual_path", [True, False])
def test_fpe_equals_the_forward_counter(tiny_llama_chat_model, ablation, stop, dual_path):
    model, tokenizer = tiny_llama_chat_model
    trigger_after = TRIGGERS if ablation in ("periodic", "random") or stop == "peek_agree" else []
    prompts = _prompts(tokenizer)
    stop_ids = _stop_ids(model, tokenizer, prompts)
    config = ReflectiveConfig(
        ablation=ablation,
        stop=stop,
        trigger_after=trigger_after,
        dual_path=dual_path,
        tau_high=0.5,
        tau_low=0.5,
        tau_stop=0.999,
        period=3,
        random_rate=0.3,
        cooldown=1,
        reflect_length=4,
        budget_total=10,
        reflect_temperature=1.0,
    )
    r_end = resolve_markers(tokenizer, config).end[0]
    handle = _boost(model, [r_end], 4.0)  # the model sometimes ends a reflection itself
    try:
        with ForwardCounter(model) as counter:
            results = reflective_generate(
                model, tokenizer, prompts, SAMPLED, [1, 2, 3], stop_ids, tokenizer.pad_token_id, config
            )
        with ForwardCounter(model) as alone_counter:  # per example, on its own: the counter agrees as well
            (alone,) = reflective_generate(
                model, tokenizer, prompts[1:2], SAMPLED, [2], stop_ids, tokenizer.pad_token_id, config
            )
    finally:
        handle.remove()
    assert counter.tokens == sum(r.usage.fpe for r in results)
    assert alone_counter.tokens == alone.usage.fpe
    assert sum(r.n_reflections for r in results) > 0
    reasons = Counter(reason for r in results for reason in r.end_reasons)
    if ablation != "fixed":
        assert reasons["model_end"] > 0  # the boosted R_END is the model's own end, under every stop rule
    peeks = stop in ("peek", "peek_agree") and ablation != "fixed"
    m_s = m_e = 1
    for r, prompt in zip(results, prompts, strict=True):
        visible_fed = len(r.token_ids) - 1  # the last visible token (stop or cap) never goes through the model
        model_ends = r.end_reasons.count("model_end")
        assert len(r.end_reasons) == len(r.reflection_lengths) == r.n_reflections
        assert r.peek_tokens == (r.hidden_tokens * m_e if peeks else 0)
        assert r.usage.fpe == len(prompt) + visible_fed + r.hidden_tokens + r.peek_tokens + r.n_reflections * m_s + (
            model_ends * m_e if peeks else r.n_reflections * m_e
        )
        assert r.hidden_tokens <= config.budget_total
        assert all(n <= config.reflect_length for n in r.reflection_lengths)
        for n, reason in zip(r.reflection_lengths, r.end_reasons, strict=True):
            assert reason != "length" or n == config.reflect_length
        if ablation == "fixed":  # no stop of any kind, whatever `stop` says
            assert set(r.end_reasons) <= {"length", "budget"}
            assert all(n == config.reflect_length for n in r.reflection_lengths[:-1])
        elif stop == "end_marker":  # no peeks at all
            assert set(r.end_reasons) <= {"model_end", "length", "budget"}
        else:
            assert set(r.end_reasons) <= {"peek", "model_end", "length", "budget"}
        if trigger_after:
            assert all(at_trigger_point(tokenizer, r.token_ids[:p], trigger_after) for p in r.reflection_positions)


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
        stop="peek",
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
        ablation="periodic", period=1, cooldown=3, reflect_length=2, budget_total=5, tau_stop=-1.0, stop="peek",
        model_may_end=False,
    )
    for r in reflective_generate(model, tokenizer, prompts, SAMPLED, [1, 2, 3], [-1], pad, periodic):
        gaps = [b - a for a, b in zip(r.reflection_positions, r.reflection_positions[1:], strict=False)]
        assert all(g >= 3 for g in gaps)
        assert r.hidden_tokens == 5 and r.reflection_lengths == [2, 2, 1]
        assert r.end_reasons == ["length", "length", "budget"]
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


# --- settings ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "field_name"),
    [
        ({"stop": "peak"}, "stop"),
        ({"check_result": r"=\s*(\d+"}, "check_result"),
        ({"check_result": r"=\s*\d+$"}, "check_result"),
        ({"check_result": r"(\d+) = (\d+)$"}, "check_result"),
        ({"trigger_after": [" = ", ""]}, "trigger_after"),
        ({"stop": "end_marker", "model_may_end": False}, "model_may_end"),
    ],
)
def test_bad_settings_are_rejected_naming_the_field(settings, field_name):
    with pytest.raises(ValueError, match=field_name):
        ReflectiveConfig(**settings)


def test_default_settings():
    config = ReflectiveConfig()
    assert (config.stop, config.reflect_temperature, config.reflect_length, config.budget_total) == (
        "end_marker", 0.0, 48, 128
    )
    assert config.trigger_after == [] and re.compile(config.check_result).groups == 1
    ReflectiveConfig(stop="end_marker", model_may_end=False, ablation="fixed")  # fixed has no stop: allowed


def test_end_marker_needs_single_id_markers():
    plain = _char_tokenizer([])  # no single-id markers: the stable-sequence fallback
    model = build_tiny_model(plain, seed=3)
    prompts, pad = _prompts(plain)[:1], plain.pad_token_id
    with pytest.raises(ValueError, match="stop=peek"):
        reflective_generate(model, plain, prompts, GREEDY, [0], [-1], pad, ReflectiveConfig(stop="end_marker"))
    (r,) = reflective_generate(model, plain, prompts, GREEDY, [0], [-1], pad, dataclasses.replace(OFTEN, stop="peek"))
    assert r.n_reflections > 0


# --- stop rules -------------------------------------------------------------------------------------------------


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _one_hot(tokenizer, token: str) -> torch.Tensor:
    logits = torch.zeros(len(tokenizer))
    logits[tokenizer.convert_tokens_to_ids(token)] = 10.0
    return logits


def test_peek_agrees_only_on_a_finished_check_whose_result_the_peek_begins(tiny_tokenizer):
    tok = tiny_tokenizer
    end_id = tok.convert_tokens_to_ids("<|/reflect|>")
    pattern = re.compile(ReflectiveConfig().check_result)

    def agrees(span: str, peek: str, following: str, check=pattern) -> bool:
        return peek_agrees(tok, _ids(tok, span), _one_hot(tok, peek), _one_hot(tok, following), check, end_id)

    assert agrees("9 * 3 = 27", "2", "<|/reflect|>")  # finished (R_END next), the peek begins 27
    assert agrees("9 * 3 = 27", "2", "\n")  # a line break also closes the check
    assert agrees("9 * 3 = 27 ", "2", "<|end|>")  # any special token does; trailing space is fine
    assert not agrees("9 * 3 = 27", "5", "<|/reflect|>")  # the peek disagrees with the check
    assert not agrees("9 * 3 = 27", "7", "<|/reflect|>")  # a suffix is not a prefix
    assert not agrees("9 * 3 = 27", " ", "<|/reflect|>")  # an empty (whitespace) guess agrees with nothing
    assert not agrees("9 * 3 = 2", "2", "7")  # the number goes on: not finished
    assert not agrees("9 * 3 = 27", "2", ",")  # another step of the check follows (the copy trap at `16 - 0 = 16,`)
    assert not agrees("9 * 3 = ", "2", "<|/reflect|>")  # no result yet
    assert not agrees("2", "2", "<|/reflect|>")  # a one-digit junk span is no check (the copy trap)
    assert agrees("so: 27", "2", "<|/reflect|>", re.compile(r":\s*(\d+)$"))  # the pattern decides what a check is
    assert not agrees("so: 27", "2", "<|/reflect|>")


# After `after` the scripted model writes `then` (a +50 logit over the random model's own): "9*3=27" lines.
SCRIPT = {"<|assistant|>": "9", "9": "*", "*": "3", "3": "=", "=": "2", "2": "7", "7": "\n", "\n": "9",
          "<|reflect|>": "9", "<|/reflect|>": "2"}


def _script(model, tokenizer, table: dict[str, str]):
    """A hook that makes `model` a bigram machine on `table`: the token after a listed token is its entry."""
    pairs = [(tokenizer.convert_tokens_to_ids(a), tokenizer.convert_tokens_to_ids(b)) for a, b in table.items()]

    def hook(module, args, kwargs, output):
        inputs = kwargs["input_ids"][:, -output.logits.shape[1] :]
        logits = output.logits.clone()
        for after, then in pairs:
            logits[..., then] += 50.0 * (inputs == after)
        output.logits = logits
        return output

    return model.register_forward_hook(hook, with_kwargs=True)


@pytest.mark.parametrize(
    ("stop", "changes", "reason", "length"),
    [
        ("end_marker", {}, "length", 10),  # the script never writes R_END
        ("peek", {}, "peek", 1),  # the sure peek ends the span after one hidden token
        ("peek_agree", {}, "peek", 6),  # ... but agrees only once `9*3=27` is written and the line ends
        ("peek_agree", {"7": ",", ",": "9"}, "length", 10),  # `27,` goes on: never finished
        ("peek_agree", {"<|/reflect|>": "5", "5": "7"}, "length", 10),  # the peek says 5, the check 27: no
    ],
)
def test_stop_rules_on_a_scripted_model(tiny_chat_model, stop, changes, reason, length):
    model, tokenizer = tiny_chat_model
    config = ReflectiveConfig(
        ablation="periodic", period=1, cooldown=0, trigger_after=["3="], stop=stop, tau_stop=0.5, reflect_length=10,
        budget_total=40, audit=True,
    )
    policy = SamplingPolicy(temperature=0.0, max_new_tokens=14)
    handle = _script(model, tokenizer, {**SCRIPT, **changes})
    try:
        results = reflective_generate(
            model, tokenizer, _prompts(tokenizer)[:2], policy, [0, 1], [-1], tokenizer.pad_token_id, config
        )
    finally:
        handle.remove()
    for r in results:
        assert r.reflection_positions == [4, 11]  # after each "9*3=" of "9*3=27\n9*3=", at the trigger point
        assert r.end_reasons == [reason, reason] and r.reflection_lengths == [length, length]
        assert r.peek_tokens == (0 if stop == "end_marker" else r.hidden_tokens)
        spans = re.findall(r"<\|reflect\|>(.*?)<\|/reflect\|>", r.audit_text, flags=re.S)
        assert len(spans) == 2 and all(len(span) == length for span in spans)
        if (stop, reason) == ("peek_agree", "peek"):
            assert spans == ["9*3=27", "9*3=27"]
        assert r.text.startswith("9*3=")
        assert "<|reflect|>" not in r.text


# --- trigger points ---------------------------------------------------------------------------------------------


def test_reflections_start_only_at_trigger_points(tiny_chat_model):
    model, tokenizer = tiny_chat_model
    prompts = _prompts(tokenizer, [f"{i} + {i + 1} = ?" for i in range(8)])
    triggers = [" = ", "=="]  # several tokens each (characters here)
    policy = SamplingPolicy(temperature=1.0, top_p=0.9, max_new_tokens=24)
    base = ReflectiveConfig(
        trigger_after=triggers, stop="peek", tau_stop=-1.0, reflect_length=2, budget_total=20, cooldown=0,
        reflection_only_tokens=["#"], reflect_temperature=1.0,
    )
    configs = {
        "gate": dataclasses.replace(base, tau_high=0.3, tau_low=0.3),
        "periodic": dataclasses.replace(base, ablation="periodic", period=3),
        "random": dataclasses.replace(base, ablation="random", random_rate=0.7),
        "never": dataclasses.replace(base, ablation="periodic", period=1, trigger_after=["#"]),  # '#' is never visible
    }
    ids = [tokenizer.convert_tokens_to_ids(c) for c in " ="]
    handle = _boost(model, ids, 6.0)  # text made mostly of ' ' and '='
    try:
        runs = {
            name: reflective_generate(model, tokenizer, prompts, policy, range(8), [-1], tokenizer.pad_token_id, c)
            for name, c in configs.items()
        }
    finally:
        handle.remove()
    for name, results in runs.items():
        n_reflections = sum(r.n_reflections for r in results)
        assert n_reflections == 0 if name == "never" else n_reflections >= 4, name
        for r in results:
            texts = [tokenizer.decode(r.token_ids[:k], skip_special_tokens=True) for k in range(len(r.token_ids))]
            assert r.at_trigger == [t.endswith(tuple(configs[name].trigger_after)) for t in texts]
            assert all(r.at_trigger[p] for p in r.reflection_positions if p < len(r.at_trigger))
            assert all(texts[p].endswith(tuple(triggers)) for p in r.reflection_positions if p < len(texts))
            if name == "periodic":  # the first trigger point once `period` visible tokens have passed
                gaps = [b - a for a, b in zip([0, *r.reflection_positions], r.reflection_positions, strict=False)]
                assert all(g >= 3 for g in gaps)
    # The same rows decoded without trigger points reflect at points that are not trigger points too.
    free = reflective_generate(
        model, tokenizer, prompts, policy, range(8), [-1], tokenizer.pad_token_id,
        dataclasses.replace(configs["periodic"], trigger_after=[]),
    )
    assert not all(
        tokenizer.decode(r.token_ids[:p], skip_special_tokens=True).endswith(tuple(triggers))
        for r in free for p in r.reflection_positions
    )


def test_trigger_point_spans_token_boundaries(tiny_tokenizer):
    ids = _ids(tiny_tokenizer, "12 * 3 = ")
    assert at_trigger_point(tiny_tokenizer, ids, [" = "]) and at_trigger_point(tiny_tokenizer, ids, ["3 = ", "x"])
    assert not at_trigger_point(tiny_tokenizer, ids[:-1], [" = "])
    assert at_trigger_point(tiny_tokenizer, [], []) and not at_trigger_point(tiny_tokenizer, [], [" = "])
    long = _ids(tiny_tokenizer, "x" * 40 + " = ")
    assert at_trigger_point(tiny_tokenizer, long, ["x" * 10 + " = "])
    # Special tokens decode to nothing in the visible text: the window grows until it holds enough text.
    pad = tiny_tokenizer.pad_token_id
    padded = _ids(tiny_tokenizer, "x =") + [pad] * 6 + _ids(tiny_tokenizer, " ")
    assert at_trigger_point(tiny_tokenizer, padded, [" = "])


# --- tuning -----------------------------------------------------------------------------------------------------


def _canned(n: int, fpe: int) -> list[ReflectiveResult]:
    return [
        ReflectiveResult([1, 2], "ab", True, Usage(fpe=fpe), n_reflections=1, hidden_tokens=3, peek_tokens=3,
                         end_reasons=["model_end"])
        for _ in range(n)
    ]


def test_choose_stop_picks_the_most_accurate_rule_and_uses_only_what_it_is_given():
    config = ReflectiveConfig(tau_high=0.3, tau_low=0.2, trigger_after=[" = "], ablation="periodic")
    grades = {"end_marker": [True, False, False, True], "peek": [False] * 4, "peek_agree": [True, True, False, True]}
    fpe = {"end_marker": 10, "peek": 20, "peek_agree": 30}
    seen = []

    def decode_and_grade(settings: ReflectiveConfig):
        seen.append(settings)
        return _canned(4, fpe[settings.stop]), grades[settings.stop]

    choice = choose_stop(decode_and_grade, config)
    assert choice.stop == "peek_agree"
    assert [s.stop for s in seen] == list(STOP_RULES)
    assert all(s == dataclasses.replace(config, stop=s.stop, ablation="gate") for s in seen)  # nothing else changes
    trials = {t.stop: t for t in choice.trials}
    assert trials["end_marker"].accuracy == 0.5 and trials["peek_agree"].accuracy == 0.75
    assert trials["peek"].fpe == 80 and trials["peek"].reflections == 4 and trials["peek"].hidden_tokens == 12
    assert trials["peek"].end_reasons == {"model_end": 4}
    # A tie goes to the lower FPE; only the candidates given are decoded.
    grades["end_marker"] = grades["peek_agree"]
    assert choose_stop(decode_and_grade, config).stop == "end_marker"
    fpe["end_marker"] = 30
    assert choose_stop(decode_and_grade, config).stop == "end_marker"  # then the earlier candidate
    seen.clear()
    assert choose_stop(decode_and_grade, config, ["peek", "peek_agree"]).stop == "peek_agree"
    assert [s.stop for s in seen] == ["peek", "peek_agree"]


def test_calibration_replays_the_gate_only_at_trigger_points():
    # u is 0.5 on every odd step (where the free gate could fire half the time), 0.3 at the trigger points (every
    # 8th step) and 0 elsewhere.
    u = [0.3 if k % 8 == 0 else 0.5 if k % 2 else 0.0 for k in range(32)]
    points = [k % 8 == 0 for k in range(32)]
    plain = [ReflectiveResult([1] * 32, "", False, Usage(), uncertainty=u, at_trigger=points) for _ in range(2)]
    config = ReflectiveConfig(tau_high=0.4, tau_low=0.4, tau_stop=0.4, cooldown=0, trigger_after=[" = "])
    calib = calibrate_tau(lambda settings: plain, config, target_rate=0.5)
    assert calib.simulated_rate == pytest.approx(1 / 8) and calib.tau_high < 0.3
    free = [dataclasses.replace(r, at_trigger=[True] * 32) for r in plain]
    assert calibrate_tau(lambda settings: free, config, target_rate=0.5).simulated_rate > 0.3
    nowhere = [dataclasses.replace(r, at_trigger=[False] * 32) for r in plain]
    with pytest.raises(ValueError, match="trigger point"):
        calibrate_tau(lambda settings: nowhere, config)


def test_matched_ablations_keep_the_stop_rule_and_the_trigger_points():
    config = ReflectiveConfig(stop="peek_agree", trigger_after=[" = "], reflect_length=48)
    ablations = matched_ablations(config, visible=1200, reflections=50, hidden=1000, trigger_points=100)
    periodic, random, fixed = (ablations[f"reflective-{k}"] for k in ("periodic", "random", "fixed"))
    for ablation in (periodic, random, fixed):
        assert ablation.trigger_after == [" = "] and ablation.stop == "peek_agree"
        assert (ablation.budget_total, ablation.tau_high) == (config.budget_total, config.tau_high)
    assert random.random_rate == pytest.approx(0.5)  # reflections per trigger point
    assert periodic.period == 19  # gap 24, points every 12: lands on the gap
    assert (fixed.ablation, fixed.reflect_length) == ("fixed", 20)
    plain = matched_ablations(ReflectiveConfig(), visible=1200, reflections=50, hidden=1000)
    assert plain["reflective-random"].random_rate == pytest.approx(50 / 1200)
    assert plain["reflective-periodic"].period == 24


def test_calibrate_stage_chooses_the_stop_rule_on_train_problems(tiny_model_dir, tmp_path, monkeypatch, capsys):
    splits = []

    def make_task(task_config, seed):
        task = real_make_task(task_config, seed)
        examples = task.examples

        def recording(split, n):
            splits.append(split)
            return examples(split, n)

        task.examples = recording
        return task

    real_make_task = calibrate.make_task
    monkeypatch.setattr(calibrate, "make_task", make_task)
    config = load_config(ROOT / "recipes" / "tiny.yaml", [
        f"model.path={tiny_model_dir}", "eval.n_other=4", "sampling.max_new_tokens=8", "reflective.reflect_length=3",
        "reflective.budget_total=6", "reflective.tau_low=0.0", "reflective.calibrate_rate=0.2",
        "reflective.trigger_after=[]",  # the recipe's " = " never comes from a random model in 8 tokens
    ])
    run = RunDir(tmp_path)
    calibrate.run_calibrate(config, run)
    assert splits == ["train"]
    lines = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    assert [line["stage"] for line in lines] == ["calibrate", "calibrate_stop", "calibrate_stop", "calibrate_stop"]
    trials = lines[1:]
    assert [t["stop"] for t in trials] == list(STOP_RULES)
    assert all(t["n"] == 4 and {"accuracy", "reflections", "hidden_tokens", "fpe", "end_reasons"} <= set(t)
               for t in trials)
    (chosen,) = [t for t in trials if t["chosen"]]
    assert chosen["accuracy"] == max(t["accuracy"] for t in trials)
    out = capsys.readouterr().out
    assert f"reflective.stop={chosen['stop']}" in out and f"reflective.tau_high={lines[0]['tau_high']:.4f}" in out
