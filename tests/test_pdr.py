"""Parallel-Distill-Refine and Sequential Refinement on a tiny random Qwen2 with an in-process chat tokenizer."""

from __future__ import annotations

import pytest

from redumix.data.chat import prompt_ids
from redumix.data.prompts import attempt_messages, format_workspace, refine_messages
from redumix.data.tasks import TaskConfig, make_task
from redumix.generate.accounting import ForwardCounter
from redumix.generate.model_io import stop_token_ids
from redumix.generate.pdr import (
    PdrConfig,
    extract_workspace,
    majority_draft,
    pdr_generate,
    rank_drafts,
    token_count,
)
from redumix.generate.plain import generate_batch
from redumix.generate.policy import SamplingPolicy

extract_answer = make_task(TaskConfig(), seed=0).answer  # the task's extraction: drafts vote with it
QUESTIONS = ["What is 2 + 3?", "Tom has 7 apples and eats 2. How many are left?"]
SEEDS = [101, 202]


def test_sr_is_pdr_with_one_draft_per_round(tiny_chat_model):
    model, tokenizer = tiny_chat_model
    policy = SamplingPolicy(temperature=0.0, max_new_tokens=10)
    config = PdrConfig(drafts=1, rounds=2, workspace_tokens=64)
    stop = stop_token_ids(model, tokenizer)
    results = pdr_generate(model, tokenizer, QUESTIONS, policy, SEEDS, stop, config, extract_answer)
    for result in results:
        assert [len(r.drafts) for r in result.rounds] == [1, 1, 1]
        assert result.rounds[0].workspace == ""
        # SR's workspace is the previous round's single draft, and its refine prompt is what the round saw.
        for before, after in zip(result.rounds, result.rounds[1:], strict=False):
            assert after.workspace == format_workspace([before.drafts[0]])
            ids = prompt_ids(tokenizer, refine_messages(QUESTIONS[results.index(result)], after.workspace))
            assert after.context_tokens == len(ids)
        assert result.text == result.rounds[-1].drafts[0]


def test_first_round_first_draft_is_plain_decoding(tiny_chat_model):
    model, tokenizer = tiny_chat_model
    stop = stop_token_ids(model, tokenizer)
    policy = SamplingPolicy(temperature=1.0, max_new_tokens=10)
    config = PdrConfig(drafts=3, rounds=0)
    results = pdr_generate(model, tokenizer, QUESTIONS, policy, SEEDS, stop, config, extract_answer)
    contexts = [prompt_ids(tokenizer, attempt_messages(q)) for q in QUESTIONS]
    plain = generate_batch(model, contexts, policy, SEEDS, stop, tokenizer.pad_token_id)
    for result, gen in zip(results, plain, strict=True):
        drafts = result.rounds[0].drafts
        assert drafts[0] == tokenizer.decode(gen.content_ids(stop), skip_special_tokens=True)
        assert len(set(drafts)) == 3  # distinct seeds per draft
        assert result.tokens_per_round == [result.usage.generated_tokens] and result.usage.generated_tokens <= 30


def test_greedy_policy_with_draft_temperature_gives_distinct_drafts(tiny_chat_model):
    model, tokenizer = tiny_chat_model
    policy = SamplingPolicy(temperature=0.0, max_new_tokens=8)
    stop = stop_token_ids(model, tokenizer)
    vote = PdrConfig(drafts=3, rounds=0)
    same = pdr_generate(model, tokenizer, QUESTIONS[:1], policy, SEEDS[:1], stop, vote, extract_answer)
    assert len(set(same[0].rounds[0].drafts)) == 1
    config = PdrConfig(drafts=3, rounds=0, draft_temperature=1.0)
    varied = pdr_generate(model, tokenizer, QUESTIONS[:1], policy, SEEDS[:1], stop, config, extract_answer)
    assert len(set(varied[0].rounds[0].drafts)) == 3


@pytest.mark.parametrize(("distill", "budget"), [("extract", 16), ("extract", 40), ("model", 12)])
def test_workspace_bound_context_and_fpe(tiny_chat_model, distill, budget):
    model, tokenizer = tiny_chat_model
    policy = SamplingPolicy(temperature=1.0, max_new_tokens=20)
    config = PdrConfig(drafts=3, rounds=2, workspace_tokens=budget, distill=distill)
    stop = stop_token_ids(model, tokenizer)
    with ForwardCounter(model) as counter:
        results = pdr_generate(model, tokenizer, QUESTIONS, policy, SEEDS, stop, config, extract_answer)
    assert sum(r.usage.fpe for r in results) == counter.tokens
    for question, result in zip(QUESTIONS, results, strict=True):
        assert len(result.rounds) == 3
        workspaces = [r.workspace for r in result.rounds[1:]]
        assert all(0 < token_count(tokenizer, w) <= budget for w in workspaces)
        # Every refine prompt is the question plus at most W workspace tokens, however many rounds run.
        bare = len(prompt_ids(tokenizer, refine_messages(question, "x"))) - 1
        assert all(r.context_tokens <= bare + budget for r in result.rounds[1:])
        if distill == "extract":
            assert result.longest_context <= max(r.context_tokens for r in result.rounds) + policy.max_new_tokens
        else:  # the distill prompt holds all N drafts, so it is the longest context
            assert result.longest_context > max(r.context_tokens for r in result.rounds) + policy.max_new_tokens
        assert result.longest_context >= result.rounds[-1].context_tokens
        assert sum(result.tokens_per_round) == result.usage.generated_tokens
        # Every sampled token is fed back except each call's last one: 3 drafts per round, plus each model distill.
        calls = 3 * len(result.rounds) + (config.rounds if distill == "model" else 0)
        assert result.usage.fpe == result.usage.prefill_tokens + result.usage.generated_tokens - calls
        if distill == "model":
            assert all(0 < r.distill_tokens <= budget for r in result.rounds[:-1])


def test_extract_workspace_ranks_answers_by_votes(tiny_chat_model):
    _, tokenizer = tiny_chat_model
    drafts = [
        "2 + 3 = 6. The answer is 6.",
        "2 + 3 = 5. The answer is 5.",
        "So 5.",
        "no idea",
        "2 + 3 = 5. The answer is 5.",
    ]
    assert rank_drafts(["6", "5", "5", None, "5"]) == [1, 0, 2, 4, 3]
    workspace = extract_workspace(tokenizer, drafts, 1000, extract_answer)
    # One draft per distinct answer first (5 has three votes), then the rest; duplicates are dropped.
    assert workspace == format_workspace([drafts[1], drafts[0], drafts[2], drafts[3]])
    small = extract_workspace(tokenizer, drafts, token_count(tokenizer, format_workspace([drafts[1]])), extract_answer)
    assert small == format_workspace([drafts[1]])


def test_extract_workspace_keeps_the_end_when_no_draft_fits(tiny_chat_model):
    _, tokenizer = tiny_chat_model
    drafts = ["First 12 + 30 = 42, then 42 - 37 = 5. The answer is 5.", "12 + 30 = 41. The answer is 41."]
    tail = extract_workspace(tokenizer, drafts, 30, extract_answer)
    assert token_count(tokenizer, tail) <= 30
    assert tail.startswith("Solution 1:\n...") and tail.endswith("answer is 5.")


def test_majority_draft():
    assert majority_draft(["6", "5", "5"]) == 1
    assert majority_draft(["6", "5"]) == 0
    assert majority_draft([None, None]) == 0
    assert majority_draft([None, "7"]) == 1


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="drafts"):
        PdrConfig(drafts=0)
    with pytest.raises(ValueError, match="rounds"):
        PdrConfig(rounds=-1)
