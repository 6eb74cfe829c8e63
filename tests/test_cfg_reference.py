"""transformers' classifier-free guidance computes the ReDuMix redo: generate(x, guidance_scale=λ,
negative_prompt_ids=x2) scores λ·log p(·|x) + (1−λ)·log p(·|x2), with its own second forward and cache. Its greedy
tokens must equal ours: an independent reference for the mixture loop."""

from __future__ import annotations

import pytest
import torch

from redumix.data.chat import prompt_ids
from redumix.data.prompts import attempt_messages, redo_messages
from redumix.generate.mixture import mixture_loop
from redumix.generate.policy import SamplingPolicy
from redumix.generate.state import prefill

STEPS = 16


@pytest.mark.parametrize("lam", [0.3, 0.5])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_redo_equals_transformers_cfg(lam, arch, tiny_chat_model, tiny_llama_chat_model):
    model, tokenizer = tiny_chat_model if arch == "qwen2" else tiny_llama_chat_model
    question = "Tom has 12 apples and eats 5. How many are left?"
    x = prompt_ids(tokenizer, attempt_messages(question))
    x2 = prompt_ids(tokenizer, redo_messages(question, "12 - 5 = 8\nThe answer is 8.", "Your final answer 8 is wrong.",
                                             "Line 1: 12 - 5 = 7, not 8."))
    assert len(x2) > 2 * len(x)  # x2 holds the attempt, feedback and reflection, as in a harvest
    pad = tokenizer.pad_token_id
    policy = SamplingPolicy(max_new_tokens=STEPS)
    eos = tokenizer.eos_token_id
    [(ours, _, _, _)] = mixture_loop(model, prefill(model, [x], pad), prefill(model, [x2], pad), lam, 8, policy,
                                     torch.zeros(1, dtype=torch.long), stop_ids=[eos])
    with torch.no_grad():
        theirs = model.generate(
            torch.tensor([x]), attention_mask=torch.ones(1, len(x), dtype=torch.long), guidance_scale=lam,
            negative_prompt_ids=torch.tensor([x2]), max_new_tokens=STEPS, do_sample=False, eos_token_id=eos,
            pad_token_id=pad,
        )[0, len(x):].tolist()
    assert len(ours.token_ids) > 3
    assert ours.token_ids == theirs  # both stop on the end-of-turn token, or run STEPS tokens
