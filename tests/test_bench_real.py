"""bench/bench_real.py at toy sizes on the tests' tiny model: every key comes out, the sides count what they emit,
and in float32 our greedy loop and `generate` decode the same tokens, so the eval keys time the same work."""

from __future__ import annotations

import math

import torch

from bench.bench_real import compare, matmul_bound, step_shapes
from bench.harvest_vs_hf import Stages, hf_harvest, ours_harvest
from bench.models import build_tiny_model

PROMPTS = ["Tom has 12 apples and eats 5. How many are left?", "2 + 2?", "Ann buys 3 pens at 4 each. Cost?"]


def test_both_harvests_count_every_token_their_stages_emit(tiny_llama_chat_model):
    model, tokenizer = tiny_llama_chat_model
    stages = Stages(answer=5, reflection=3)
    with torch.no_grad():
        for harvest in (ours_harvest, hf_harvest):
            for redo in harvest(model, tokenizer, PROMPTS, stages):
                # Each stage runs to its cap or its stop token: the redo's own tokens plus at most 5 + 3 before it.
                assert len(redo.token_ids) < redo.generated <= len(redo.token_ids) + 5 + 3


def test_every_key_comes_out_and_float32_decodes_the_same_tokens(tiny_llama_chat_model):
    float32, tokenizer = tiny_llama_chat_model
    bf16 = build_tiny_model(tokenizer, arch="llama", seed=1).to(torch.bfloat16)
    found = compare(bf16, float32, tokenizer, PROMPTS, Stages(6, 4), eval_tokens=6, key="toy")
    for stage in ("harvest", "eval"):
        assert found[f"real_toy_{stage}_bf16_vs_hf_float32_b3"] > 0
        assert found[f"real_toy_{stage}_float32_vs_hf_float32_b3"] > 0
        assert all(found[f"real_toy_{stage}_tokens_per_s_{side}"] > 0
                   for side in ("ours_bf16", "ours_float32", "hf_float32"))
    assert found["real_toy_eval_float32_ids_match_hf"] == 1.0
    assert 0 <= found["real_toy_harvest_bf16_ids_match"] <= 1 and 0 <= found["real_toy_eval_bf16_ids_match"] <= 1
    assert found["real_toy_harvest_bf16_logprob_gap_entries"] > 0
    assert 0 <= found["real_toy_harvest_bf16_logprob_gap_median"] <= found["real_toy_harvest_bf16_logprob_gap_max"]
    assert math.isfinite(found["real_toy_harvest_bf16_logprob_gap_max"])


def test_the_matmul_bound_runs_every_linear_of_a_step(tiny_llama_chat_model):
    config = tiny_llama_chat_model[0].config
    shapes = step_shapes(config)
    assert len(shapes) == 7 * config.num_hidden_layers + 1 and shapes[-1] == (config.hidden_size, config.vocab_size)
    threads = torch.get_num_threads()
    assert step_shapes(config, head=False) == shapes[:-1]
    assert matmul_bound(config, batch=4, min_seconds=0.01) > 0 and matmul_bound(config, 8, False, 0.01) > 0
    assert torch.get_num_threads() == threads  # one thread inside, the caller's count restored
