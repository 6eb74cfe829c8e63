"""Mixture of Inputs: reduces to plain decoding where the method says it must, mixes embeddings as the formula says,
and costs exactly the positions it feeds through the model."""

from __future__ import annotations

import math

import pytest
import torch

from redumix.data.chat import prompt_ids
from redumix.data.prompts import attempt_messages
from redumix.generate.accounting import ForwardCounter
from redumix.generate.moi import MoiConfig, moi_generate, moi_step, moi_weights
from redumix.generate.plain import generate_batch
from redumix.generate.policy import SamplingPolicy

QUESTIONS = ["What is 2 + 3?", "Tom has 7 apples and eats 2. How many are left?", "9 * 4 = ?"]


def _prompts(tokenizer) -> list[list[int]]:
    return [prompt_ids(tokenizer, attempt_messages(q)) for q in QUESTIONS]


def _stop_ids(model, prompts, policy) -> list[int]:
    # A random model rarely emits eos, so stop on a token plain decoding emits mid-answer: rows then finish at
    # different steps and the compaction path runs.
    plain = generate_batch(model, prompts, policy, [11, 12, 13], [-1], model.config.pad_token_id, max_new_tokens=12)
    return [plain[0].token_ids[4]]


def test_one_hot_p_gives_plain_decoding_tokens(tiny_chat_model):
    model, tokenizer = tiny_chat_model
    prompts = _prompts(tokenizer)
    policy = SamplingPolicy(temperature=0.0, max_new_tokens=12)
    stop = _stop_ids(model, prompts, policy)
    plain = generate_batch(model, prompts, policy, [1, 2, 3], stop, tokenizer.pad_token_id)
    moi = moi_generate(model, prompts, policy, [1, 2, 3], stop, tokenizer.pad_token_id, MoiConfig(topk=1))
    assert [g.token_ids for g in moi] == [g.token_ids for g in plain]
    assert [g.finished for g in moi] == [g.finished for g in plain]
    assert any(g.finished for g in moi) and not all(g.finished for g in moi)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_huge_beta_gives_plain_decoding_tokens(tiny_chat_model, temperature):
    model, tokenizer = tiny_chat_model
    prompts = _prompts(tokenizer)
    # With the policy's support inside MoI's top-k, both draw the same token from the same hashed noise.
    policy = SamplingPolicy(temperature=temperature, top_k=20, max_new_tokens=12)
    stop = _stop_ids(model, prompts, policy)
    plain = generate_batch(model, prompts, policy, [5, 6, 7], stop, tokenizer.pad_token_id)
    moi = moi_generate(model, prompts, policy, [5, 6, 7], stop, tokenizer.pad_token_id, MoiConfig(beta=1e9))
    assert [g.token_ids for g in moi] == [g.token_ids for g in plain]


def test_default_beta_changes_the_inputs_and_so_the_text(tiny_chat_model):
    model, tokenizer = tiny_chat_model
    prompts = _prompts(tokenizer)
    policy = SamplingPolicy(temperature=0.0, max_new_tokens=12)
    plain = generate_batch(model, prompts, policy, [1, 2, 3], [-1], tokenizer.pad_token_id)
    moi = moi_generate(model, prompts, policy, [1, 2, 3], [-1], tokenizer.pad_token_id, MoiConfig())
    # The first token comes from the prompt alone; later ones see mixed inputs of a near-uniform random model.
    assert [g.token_ids[0] for g in moi] == [g.token_ids[0] for g in plain]
    assert [g.token_ids for g in moi] != [g.token_ids for g in plain]


def test_weights_match_hand_computation():
    p = torch.tensor([[0.5, 0.3, 0.2]])
    ids = torch.tensor([[4, 1, 2]])
    sampled = torch.tensor([1])
    beta = 1.0
    entropy = -(0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.2))
    h = entropy / math.log(3)
    expected = [h * 0.5 / 2, (h * 0.3 + 2 - h) / 2, h * 0.2 / 2]
    weights = moi_weights(p, ids, sampled, beta)
    assert weights[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert float(weights.sum()) == pytest.approx(1.0, abs=1e-6)


def test_mixed_embedding_matches_hand_computation():
    # Vocabulary of 5, k = 3: the two lowest logits fall outside the top-k.
    logits = torch.tensor([[2.0, 1.0, 0.0, -5.0, -6.0]])
    embedding = torch.arange(10, dtype=torch.float32).reshape(5, 2)
    config = MoiConfig(beta=0.5, topk=3)
    tokens, mixed = moi_step(logits, embedding, SamplingPolicy(), torch.tensor([0]), 0, config)
    assert tokens.tolist() == [0]  # greedy policy: the argmax
    q = [math.exp(x) for x in (2.0, 1.0, 0.0)]
    p = [x / sum(q) for x in q]
    h = -sum(x * math.log(x) for x in p) / math.log(3)
    w = [(h * p[i] + (config.beta + 1 - h) * (i == 0)) / (config.beta + 1) for i in range(3)]
    expected = [sum(w[i] * float(embedding[i, d]) for i in range(3)) for d in range(2)]
    assert mixed[0].tolist() == pytest.approx(expected, abs=1e-5)


def test_fpe_equals_forward_counter_and_greedy(tiny_chat_model):
    model, tokenizer = tiny_chat_model
    prompts = _prompts(tokenizer)
    policy = SamplingPolicy(temperature=0.8, max_new_tokens=10)
    stop = _stop_ids(model, prompts, policy)
    with ForwardCounter(model) as counter:
        moi = moi_generate(model, prompts, policy, [1, 2, 3], stop, tokenizer.pad_token_id, MoiConfig())
    assert sum(g.usage.fpe for g in moi) == counter.tokens
    for gen, prompt in zip(moi, prompts, strict=True):
        assert gen.usage.prefill_tokens == len(prompt)
        # Plain decoding's cost for the same length: the prompt plus every sampled token but the last.
        assert gen.usage.fpe == len(prompt) + len(gen.token_ids) - 1
        assert gen.cached == len(gen.token_ids) - 1


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="beta"):
        MoiConfig(beta=-1)
    with pytest.raises(ValueError, match="topk"):
        MoiConfig(topk=0)
