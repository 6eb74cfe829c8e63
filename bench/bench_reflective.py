"""Dual-path batched peeks versus sequential peeks in a hidden reflection (seed 3.4, `make bench`).

One reflection of REFLECT_LENGTH hidden tokens, with a peek after every one of them (τ_stop = −1 so the peek never
stops it early), on a random Llama of the embedded default's shape (hidden 192, 4 layers). Sequential: the hidden
token and its R_END peek are two forward passes. Dual-path: one pass with both. Same tokens, same FPE; the runs
alternate and the medians are compared. Prefill is outside the timed region's difference (both runs pay it).
"""

from __future__ import annotations

import statistics
import string
import time

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from redumix.generate.policy import SamplingPolicy
from redumix.generate.reflective import ReflectiveConfig, reflective_generate

REFLECT_LENGTH = 48
REPEATS = 5


def _tokenizer() -> PreTrainedTokenizerFast:
    specials = ["<|pad|>", "<|end|>", "<|reflect|>", "<|/reflect|>"]
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    core = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate([*specials, *chars, "<|unk|>"])},
                                      unk_token="<|unk|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|pad|>", eos_token="<|end|>",
                                   unk_token="<|unk|>", additional_special_tokens=specials[2:])


def _model(vocab_size: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=192, num_hidden_layers=4, num_attention_heads=6,
                         num_key_value_heads=6, intermediate_size=512, max_position_embeddings=1024)
    return LlamaForCausalLM(config).eval()


def _time_reflection(model, tokenizer, prompts, dual_path: bool) -> float:
    # τ_high = τ_low = 0 with budget = L: exactly one reflection, at the first step, of exactly L hidden tokens.
    config = ReflectiveConfig(tau_high=0.0, tau_low=0.0, tau_stop=-1.0, reflect_length=REFLECT_LENGTH,
                              budget_total=REFLECT_LENGTH, model_may_end=False, dual_path=dual_path)
    policy = SamplingPolicy(temperature=1.0, top_p=0.95, max_new_tokens=1)
    start = time.perf_counter()
    results = reflective_generate(model, tokenizer, prompts, policy, range(len(prompts)), [-1],
                                  tokenizer.pad_token_id, config)
    elapsed = time.perf_counter() - start
    assert all(r.hidden_tokens == REFLECT_LENGTH for r in results)
    return elapsed


def _speedup(model, tokenizer, prompts) -> float:
    _time_reflection(model, tokenizer, prompts, True)  # warm-up
    sequential, dual = [], []
    for _ in range(REPEATS):
        sequential.append(_time_reflection(model, tokenizer, prompts, False))
        dual.append(_time_reflection(model, tokenizer, prompts, True))
    return statistics.median(sequential) / statistics.median(dual)


def run() -> dict[str, float]:
    tokenizer = _tokenizer()
    model = _model(len(tokenizer))
    prompt = tokenizer("Ann has 47 apples. She buys 38 more and gives 12 away. How many now? ")["input_ids"]
    return {
        "peek_batching_speedup": _speedup(model, tokenizer, [prompt]),
        "peek_batching_speedup_batch8": _speedup(model, tokenizer, [prompt] * 8),
    }


if __name__ == "__main__":
    print(run())
