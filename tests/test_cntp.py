"""Cautious Next Token Prediction on tiny random chat models built in-process.

A random model is unsure everywhere (its entropy is near log V), so `entropy_low=0` makes every step branch.
"""

from __future__ import annotations

import math

import pytest
import torch

from redumix.data.chat import prompt_ids
from redumix.data.prompts import attempt_messages
from redumix.data.tasks import TaskConfig, make_task
from redumix.generate.accounting import ForwardCounter
from redumix.generate.cntp import (
    CntpConfig,
    CntpDecoder,
    cntp_generate,
    entropy_nats,
    punctuation_mask,
    trial_counts,
)
from redumix.generate.hf_engine import HfEngine
from redumix.generate.model_io import stop_token_ids
from redumix.generate.plain import PlainDecoder
from redumix.generate.policy import SamplingPolicy

TASK = make_task(TaskConfig(), seed=0)
QUESTIONS = ["What is 2 + 3?", "Tom has 7 apples and eats 2. How many are left?", "5 * 4 = ?"]
SEEDS = [11, 22, 33]
GREEDY = SamplingPolicy(temperature=0.0, max_new_tokens=20)


def generate(model, tokenizer, config, policy=GREEDY, questions=QUESTIONS, seeds=SEEDS):
    prompts = [prompt_ids(tokenizer, attempt_messages(q)) for q in questions]
    stop = stop_token_ids(model, tokenizer)
    return prompts, cntp_generate(model, tokenizer, prompts, policy, seeds, stop, config)


def ends_trial(tokenizer, token: int, punctuation: str, stop: list[int]) -> bool:
    return token in stop or any(ch in tokenizer.decode([token], skip_special_tokens=True) for ch in punctuation)


# --- accounting ---------------------------------------------------------------------------------------------------


def test_fpe_matches_forward_counter_and_is_batch_independent(tiny_llama_chat_model):
    model, tokenizer = tiny_llama_chat_model
    examples = TASK.examples("test", 4)
    decoder = CntpDecoder("cntp", CntpConfig(max_trials=3, entropy_low=0.0, trial_max_tokens=6), GREEDY, seed=5)
    with ForwardCounter(model) as counter:
        batch = decoder(HfEngine(model, tokenizer), examples, TASK)
    assert sum(d.usage.fpe for d in batch) == counter.tokens
    for d in batch:
        assert d.extra["trial_steps"] > 0 and d.extra["trials"] == 3 * d.extra["trial_steps"]
        assert d.usage.generated_tokens > d.usage.visible_tokens == len(d.token_ids)
        assert d.text == tokenizer.decode(d.token_ids, skip_special_tokens=True)
    # Each example's FPE is its own: alone, it costs the model exactly what the batch charged it, for the same text.
    with ForwardCounter(model) as alone_counter:
        alone = decoder(HfEngine(model, tokenizer), examples[2:3], TASK)[0]
    assert alone.usage.fpe == alone_counter.tokens == batch[2].usage.fpe
    assert alone.token_ids == batch[2].token_ids


# --- the choice among trials --------------------------------------------------------------------------------------


@torch.inference_mode()
def mean_nll(model, context: list[int], continuation: list[int]) -> float:
    """−mean log p(continuation | context) from one plain forward pass over the whole sequence, no cache."""
    ids = torch.tensor([context + continuation])
    logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    start = len(context) - 1  # the logits at position i predict token i + 1
    picked = [logprobs[start + j, tok] for j, tok in enumerate(continuation)]
    return -float(sum(picked)) / len(continuation)


def test_kept_trial_has_the_lowest_perplexity(tiny_chat_model):
    model, tokenizer = tiny_chat_model
    config = CntpConfig(max_trials=3, entropy_low=0.0, trial_max_tokens=5)
    prompts, results = generate(model, tokenizer, config)
    for prompt, result in zip(prompts, results, strict=True):
        tokens, branches = result.generation.token_ids, result.branches
        # Every step branches, so the kept trials tile the answer.
        assert [b.position for b in branches] == [0, *[b.position + len(b.trials[b.kept]) for b in branches[:-1]]]
        assert branches[-1].position + len(branches[-1].trials[branches[-1].kept]) == len(tokens)
        # Each trial draws its own noise: at most branch points the three trials differ.
        assert sum(len({tuple(t) for t in b.trials}) > 1 for b in branches) * 2 > len(branches)
        for branch in branches:
            assert len(branch.trials) == 3 and branch.entropy > 1.5
            context = prompt + tokens[: branch.position]
            recomputed = [mean_nll(model, context, trial) for trial in branch.trials]
            assert branch.mean_nll == pytest.approx(recomputed, abs=1e-4)
            assert recomputed[branch.kept] <= min(recomputed) + 1e-5
            kept = branch.trials[branch.kept]
            assert tokens[branch.position : branch.position + len(kept)] == kept
        usage = result.generation.usage
        assert usage.generated_tokens == sum(len(t) for b in branches for t in b.trials)
        assert usage.visible_tokens == len(tokens)


# --- reductions ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy",
    [SamplingPolicy(max_new_tokens=24), SamplingPolicy(temperature=0.8, top_p=0.9, max_new_tokens=24)],
    ids=["greedy", "sampled"],
)
def test_without_branches_cntp_is_plain_decoding(tiny_chat_model, policy):
    model, tokenizer = tiny_chat_model
    examples = TASK.examples("test", 5)
    never = CntpConfig(entropy_low=50.0, entropy_high=60.0)  # far above log V: no step is unsure enough
    cntp = CntpDecoder("same-name", never, policy, seed=3)(HfEngine(model, tokenizer), examples, TASK)
    plain = PlainDecoder("same-name", policy, seed=3)(HfEngine(model, tokenizer), examples, TASK)
    for c, p in zip(cntp, plain, strict=True):
        assert (c.text, c.token_ids, c.usage) == (p.text, p.token_ids, p.usage)
        assert c.extra == {"trial_steps": 0, "trials": 0}


def test_trials_at_near_zero_temperature_are_the_greedy_continuation(tiny_chat_model):
    model, tokenizer = tiny_chat_model
    examples = TASK.examples("test", 3)
    config = CntpConfig(max_trials=2, entropy_low=0.0, trial_temperature=1e-4)
    cntp = CntpDecoder("cntp", config, GREEDY, seed=3)(HfEngine(model, tokenizer), examples, TASK)
    plain = PlainDecoder("greedy", GREEDY, seed=3)(HfEngine(model, tokenizer), examples, TASK)
    for c, p in zip(cntp, plain, strict=True):
        assert c.token_ids == p.token_ids and c.extra["trial_steps"] > 0


# --- trials -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("punctuation", [CntpConfig().punctuation, "aeiou"])
def test_trials_end_at_their_first_punctuation_stop_or_cap(tiny_chat_model, punctuation):
    model, tokenizer = tiny_chat_model
    policy = SamplingPolicy(temperature=0.0, max_new_tokens=30)
    config = CntpConfig(max_trials=4, entropy_low=0.0, trial_max_tokens=6, punctuation=punctuation)
    _, results = generate(model, tokenizer, config, policy)
    stop = stop_token_ids(model, tokenizer)
    endings = {"punctuation": 0, "cap": 0}
    for result in results:
        for branch in result.branches:
            cap = min(config.trial_max_tokens, policy.max_new_tokens - branch.position)
            for trial in branch.trials:
                assert 1 <= len(trial) <= cap
                assert not any(ends_trial(tokenizer, t, punctuation, stop) for t in trial[:-1])
                if ends_trial(tokenizer, trial[-1], punctuation, stop):
                    endings["punctuation"] += 1
                else:
                    assert len(trial) == cap
                    endings["cap"] += 1
    assert endings["punctuation"] > 0 and endings["cap"] > 0  # both ways of ending were exercised


def test_punctuation_mask_marks_exactly_the_punctuation_ids(tiny_tokenizer):
    mask = punctuation_mask(tiny_tokenizer, ".,\n", len(tiny_tokenizer) + 3)
    expected = {tiny_tokenizer.convert_tokens_to_ids(ch) for ch in ".,\n"}
    assert set(mask.nonzero().flatten().tolist()) == expected


# --- trial counts -------------------------------------------------------------------------------------------------


def test_trial_count_grows_linearly_with_entropy():
    entropy = torch.tensor([0.0, 0.01, 0.5, 0.755, 1.4999, 1.5, 4.0])
    # k = 1 + floor(9 · (H − 0.01) / 1.49), clamped to [1, 10]: the public code's rule at its defaults.
    assert trial_counts(entropy, CntpConfig()).tolist() == [1, 1, 3, 5, 9, 10, 10]
    assert trial_counts(entropy, CntpConfig(max_trials=1)).tolist() == [1] * 7


def test_entropy_is_in_nats_and_ignores_impossible_tokens():
    uniform = torch.log_softmax(torch.zeros(1, 8), dim=-1)
    certain = torch.log_softmax(torch.tensor([[0.0, float("-inf"), float("-inf")]]), dim=-1)
    assert entropy_nats(uniform).item() == pytest.approx(math.log(8))
    assert entropy_nats(certain).item() == 0.0


# --- config -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_trials", 0),
        ("entropy_low", -0.1),
        ("entropy_high", 0.01),
        ("trial_temperature", 0.0),
        ("trial_max_tokens", 0),
        ("punctuation", ""),
    ],
)
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        CntpConfig(**{field: value})
