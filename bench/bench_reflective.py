"""Dual-path batched peeks versus sequential peeks in a hidden reflection (`make bench`).

One reflection of REFLECT_LENGTH hidden tokens, with a peek after every one of them (τ_stop = −1 so the peek never
stops it early), on a seed-built random Llama of the embedded default's shape (bench/models.py: hidden 96,
4 layers, vocabulary 768) with its `<|reflect|>` markers. Sequential: the hidden
token and its R_END peek are two forward passes. Dual-path: one pass with both. Same tokens, same FPE; the runs
alternate in pairs, dealt out over rounds through both keys (`round_robin`), and the median pair ratio is kept.
Prefill is outside the timed region's difference (both runs pay it).
Ceiling ≈2 where a forward costs its call (this small model, a GPU's decode), ≈1 where it costs its rows.
"""

from __future__ import annotations

from bench.bench_decode import Pairs, round_robin, timed
from bench.models import embedded_model, embedded_tokenizer
from redumix.generate.policy import SamplingPolicy
from redumix.generate.reflective_config import ReflectiveConfig
from redumix.generate.reflective_loop import reflective_generate

REFLECT_LENGTH = 48
REPEATS = 9  # pairs; a side shorter than MIN_SECONDS is repeated by `timed` to fill it


def _config(dual_path: bool) -> ReflectiveConfig:
    # τ_high = τ_low = 0 with budget = L: exactly one reflection, at the first step, of exactly L hidden tokens.
    return ReflectiveConfig(tau_high=0.0, tau_low=0.0, tau_stop=-1.0, reflect_length=REFLECT_LENGTH,
                            budget_total=REFLECT_LENGTH, model_may_end=False, stop="peek", dual_path=dual_path)


def _reflect(model, tokenizer, prompts, config: ReflectiveConfig) -> None:
    policy = SamplingPolicy(temperature=1.0, top_p=0.95, max_new_tokens=1)
    results = reflective_generate(model, tokenizer, prompts, policy, range(len(prompts)), [-1],
                                  tokenizer.pad_token_id, config)
    assert all(r.hidden_tokens == REFLECT_LENGTH for r in results)


def _pairs(model, tokenizer, prompts) -> Pairs:
    """Sequential time over dual-path time: the speedup."""
    sequential, dual = _config(dual_path=False), _config(dual_path=True)
    return Pairs(lambda: timed(lambda: _reflect(model, tokenizer, prompts, sequential)),
                 lambda: timed(lambda: _reflect(model, tokenizer, prompts, dual)), REPEATS)


def run() -> dict[str, float]:
    tokenizer = embedded_tokenizer()
    model = embedded_model(tokenizer)
    prompt = tokenizer("Ann has 47 apples. She buys 38 more and gives 12 away. How many now? ")["input_ids"]
    return round_robin({
        "peek_batching_speedup": _pairs(model, tokenizer, [prompt]),
        "peek_batching_speedup_batch8": _pairs(model, tokenizer, [prompt] * 8),
    }, label="bench_reflective")


if __name__ == "__main__":
    print(run())
