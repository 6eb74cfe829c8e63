import math
from pathlib import Path

import pytest
import torch

from bench.models import build_tiny_model
from redumix.data.chat import prompt_ids, template_pieces
from redumix.data.gsm8k import load_gsm8k
from redumix.data.prompts import attempt_messages, redo_messages
from redumix.data.task import Example
from redumix.data.tasks import TaskConfig, make_task
from redumix.generate.accounting import ForwardCounter
from redumix.generate.hf_engine import HfEngine
from redumix.generate.mixture import mixture_topk
from redumix.generate.model_io import stop_token_ids
from redumix.generate.plain import generate_batch
from redumix.generate.policy import SamplingPolicy, example_seed
from redumix.generate.redumix import RedumixConfig, redumix_generate

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"
PROMPTS = ["What is 3 + 4?", "Tom has 12 apples and eats 5. How many are left?", "2 * 8 = ?"]
IDS = ["a", "b", "c"]
ARITH = make_task(TaskConfig(), seed=0)
SEVEN = Example("seven", "arith", "What is 3 + 4?", "7")  # the verifier judges every attempt against 7


def run(model, tokenizer, lam, policy=None, prompts=PROMPTS, ids=IDS, feedback="verifier", seed=0, **config):
    policy = policy or SamplingPolicy(max_new_tokens=12)
    config = RedumixConfig(lam=lam, reflection_max_tokens=10, critique_max_tokens=6, feedback=feedback, **config)
    fb = None if feedback == "self" else (lambda i, text: ARITH.feedback(text, SEVEN))
    return redumix_generate(HfEngine(model, tokenizer), prompts, ids, config, policy, seed, fb)


def seeds_for(stage, ids=IDS, seed=0):
    return [example_seed(seed, f"{eid}/{stage}") for eid in ids]


def test_lam_one_is_plain_decoding_from_x(tiny_chat_model):
    model, tok = tiny_chat_model
    results = run(model, tok, lam=1.0)
    plain = generate_batch(
        model,
        [prompt_ids(tok, attempt_messages(p)) for p in PROMPTS],
        SamplingPolicy(max_new_tokens=12),
        seeds_for("redo"),
        stop_token_ids(model, tok),
        tok.pad_token_id,
    )
    for res, gen in zip(results, plain, strict=True):
        assert res.redo_token_ids == gen.token_ids
        assert res.original_ids == gen.content_ids(stop_token_ids(model, tok))  # greedy attempt == greedy redo at λ=1


def test_lam_zero_is_plain_decoding_from_x2(tiny_chat_model):
    model, tok = tiny_chat_model
    policy = SamplingPolicy(temperature=0.9, top_p=0.95, max_new_tokens=12)
    results = run(model, tok, lam=0.0, policy=policy, seed=3)
    x2 = []
    for p, res in zip(PROMPTS, results, strict=True):
        pieces = template_pieces(tok, redo_messages(p, res.original, res.feedback, res.reflection))
        x2.append(pieces[0] + res.original_ids + pieces[1] + res.reflection_ids + pieces[2])
    plain = generate_batch(model, x2, policy, seeds_for("redo", seed=3), stop_token_ids(model, tok), tok.pad_token_id)
    for res, gen in zip(results, plain, strict=True):
        assert res.redo_token_ids == gen.token_ids


def test_mixture_topk_is_descending_and_a_subdistribution(tiny_chat_model):
    model, tok = tiny_chat_model
    results = run(model, tok, lam=0.5, policy=SamplingPolicy(temperature=1.0, max_new_tokens=12), topk=8)
    for res in results:
        assert len(res.topk_ids) == len(res.redo_token_ids) > 0
        for ids, lps in zip(res.topk_ids, res.topk_logprobs, strict=True):
            assert len(ids) == len(lps) == 8
            assert all(a >= b for a, b in zip(lps, lps[1:], strict=False))
            assert math.fsum(math.exp(v) for v in lps) <= 1 + 1e-5


@pytest.mark.parametrize("masked", [0.0, -1.0e4, float("-inf")])
def test_tail_is_exact_with_masked_or_extreme_logits(masked):
    """The tail equals a float64 logsumexp outside the top-k, also where most logits sit far below the rest (a
    masked vocabulary, whose float32 exp the code keeps off its subnormal slow path), and is −inf when the top-k
    holds the whole vocabulary."""
    gen = torch.Generator().manual_seed(0)
    logits_x, logits_x2 = torch.randn(4, 600, generator=gen) * 30, torch.randn(4, 600, generator=gen) * 30
    logits_x[:, 100:] += masked
    logits_x2[:, 100:] += masked
    mix, top, tail = mixture_topk(logits_x, logits_x2, 0.3, 8)
    expected = torch.logsumexp(mix.double().scatter(-1, top.indices, float("-inf")), dim=-1)
    torch.testing.assert_close(tail.double(), expected, atol=1e-5, rtol=0)
    *_, whole = mixture_topk(logits_x[:, :8], logits_x2[:, :8], 0.3, 8)
    assert torch.all(whole == float("-inf"))


@pytest.mark.parametrize("lam", [0, 1, 0.0, 1.0])
def test_lambda_at_an_end_is_that_context_exactly(lam):
    """λ = 1 is plain decoding from x and λ = 0 from x2, bit for bit, also where the other context rules ids out
    (−inf): a weighted sum would make those 0·−inf = NaN."""
    gen = torch.Generator().manual_seed(1)
    logits_x, logits_x2 = torch.randn(3, 50, generator=gen), torch.randn(3, 50, generator=gen)
    logits_x[:, 40:], logits_x2[:, :10] = float("-inf"), float("-inf")
    mix, top, tail = mixture_topk(logits_x, logits_x2, lam, 5)
    assert torch.equal(mix, torch.log_softmax(logits_x if lam == 1 else logits_x2, dim=-1))
    assert not (mix.isnan().any() or top.values.isnan().any() or tail.isnan().any())


@pytest.mark.parametrize("lam", [0.3, 0.0, 1.0])
def test_mixture_is_the_normalised_geometric_mean(tiny_chat_model, lam):
    """At the first redo token, the stored p_mix equals softmax(λ log p1 + (1-λ) log p2), computed by hand; at λ = 0
    or 1 the loop decodes one context, and the stored p_mix is still the formula's."""
    model, tok = tiny_chat_model
    [res] = run(model, tok, lam=lam, prompts=PROMPTS[:1], ids=IDS[:1], topk=len(tok))
    x = prompt_ids(tok, attempt_messages(PROMPTS[0]))
    pieces = template_pieces(tok, redo_messages(PROMPTS[0], res.original, res.feedback, res.reflection))
    x2 = pieces[0] + res.original_ids + pieces[1] + res.reflection_ids + pieces[2]
    with torch.no_grad():
        lp1 = torch.log_softmax(model(torch.tensor([x])).logits[0, -1], -1)
        lp2 = torch.log_softmax(model(torch.tensor([x2])).logits[0, -1], -1)
    expected = torch.log_softmax(lam * lp1 + (1 - lam) * lp2, -1)
    stored = torch.full_like(expected, float("nan"))
    stored[torch.tensor(res.topk_ids[0])] = torch.tensor(res.topk_logprobs[0])
    torch.testing.assert_close(stored, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("feedback", "lam"), [("verifier", 0.5), ("self", 0.5), ("verifier", 0.0)])
def test_reported_fpe_equals_forward_counter(tiny_chat_model, feedback, lam):
    model, tok = tiny_chat_model
    with ForwardCounter(model) as counter:
        results = run(
            model, tok, lam=lam, policy=SamplingPolicy(temperature=1.0, max_new_tokens=12), feedback=feedback
        )
    assert sum(r.usage.fpe for r in results) == counter.tokens
    assert all(r.usage.prefill_tokens > 0 for r in results)


def test_rows_do_not_depend_on_their_batch(tiny_chat_model):
    model, tok = tiny_chat_model
    policy = SamplingPolicy(temperature=1.0, max_new_tokens=12)
    together = run(model, tok, lam=0.5, policy=policy, seed=5)
    alone = run(model, tok, lam=0.5, policy=policy, prompts=PROMPTS[1:2], ids=IDS[1:2], seed=5)
    assert together[1].redo_token_ids == alone[0].redo_token_ids
    assert together[1].reflection == alone[0].reflection


def test_overflowing_x2_compresses_the_attempt_and_records_it(tiny_tokenizer):
    policy = SamplingPolicy(max_new_tokens=30)
    roomy = build_tiny_model(tiny_tokenizer, max_positions=4096)
    [full] = run(roomy, tiny_tokenizer, lam=0.5, policy=policy, prompts=PROMPTS[:1], ids=IDS[:1])
    assert full.meta["y1_compressed_tokens"] == 0
    window = full.meta["tokens"]["x2"] - full.meta["tokens"]["reflection"] + 10 + 30 - 4  # worst case less 4
    tight = build_tiny_model(tiny_tokenizer, max_positions=window)  # same seed, so the same weights
    with ForwardCounter(tight) as counter:
        [res] = run(tight, tiny_tokenizer, lam=0.5, policy=policy, prompts=PROMPTS[:1], ids=IDS[:1])
    assert res.meta["y1_compressed_tokens"] >= 4
    assert res.usage.fpe == counter.tokens
    assert res.meta["tokens"]["x2"] + len(res.redo_token_ids) <= window


@pytest.mark.skipif(not GSM8K.is_file(), reason="shared GSM8K files not present")
def test_runs_on_real_gsm8k_prompts(tiny_chat_model):
    model, tok = tiny_chat_model
    examples = load_gsm8k(GSM8K)[:4]
    results = run(model, tok, lam=0.5, prompts=[e.prompt for e in examples], ids=[e.id for e in examples])
    assert len(results) == 4 and all(r.redo_token_ids for r in results)


def test_stored_tail_is_the_mass_outside_the_topk(tiny_chat_model):
    """At the first redo token, tail = log Σ_{i ∉ top-k} p_mix(i), computed here by hand from the two contexts."""
    model, tok = tiny_chat_model
    lam, k = 0.4, 6
    [res] = run(model, tok, lam=lam, prompts=PROMPTS[:1], ids=IDS[:1], topk=k)
    assert len(res.tail_logprobs) == len(res.redo_token_ids)
    x = prompt_ids(tok, attempt_messages(PROMPTS[0]))
    pieces = template_pieces(tok, redo_messages(PROMPTS[0], res.original, res.feedback, res.reflection))
    x2 = pieces[0] + res.original_ids + pieces[1] + res.reflection_ids + pieces[2]
    with torch.no_grad():
        lp1 = torch.log_softmax(model(torch.tensor([x])).logits[0, -1].double(), -1)
        lp2 = torch.log_softmax(model(torch.tensor([x2])).logits[0, -1].double(), -1)
    mix = torch.log_softmax(lam * lp1 + (1 - lam) * lp2, -1)
    outside = torch.ones_like(mix, dtype=torch.bool)
    outside[torch.tensor(res.topk_ids[0])] = False
    assert res.tail_logprobs[0] == pytest.approx(float(torch.logsumexp(mix[outside], 0)), abs=1e-4)
    total = math.fsum(math.exp(v) for v in res.topk_logprobs[0]) + math.exp(res.tail_logprobs[0])
    assert total == pytest.approx(1.0, abs=1e-5)


def test_feedback_ablations_none_and_random() -> None:
    from redumix.data.prompts import REFLECT, reflect_messages
    from redumix.generate.redumix import task_feedback

    examples = [Example(f"e{i}", "arith", "What is 3 + 4?", "7") for i in range(400)]
    none = task_feedback("none", ARITH, examples, seed=0)
    assert none(0, "3 + 4 = 7\nThe answer is 7.") == ""
    assert reflect_messages("p", "a", "")[-1]["content"] == REFLECT  # reflect only, no empty feedback line
    random_verdict = task_feedback("random", ARITH, examples, seed=0)
    right = [random_verdict(i, "The answer is 7.") for i in range(400)]
    wrong = [random_verdict(i, "The answer is 8.") for i in range(400)]
    # The verdict ignores the truth: the same coin per example whatever the answer, heads about half the time.
    assert [v.endswith("correct.") for v in right] == [v.endswith("correct.") for v in wrong]
    assert 0.4 < sum(v.endswith("correct.") for v in right) / 400 < 0.6
    assert all("7" in v for v in right) and all("8" in v for v in wrong)  # it names the attempt's own answer
    assert random_verdict(0, "no number here") == ARITH.feedback("no number here", examples[0])
