"""Decoding benchmarks. Every number is a ratio of two timings taken side by side in one run, interleaved and
repeated, with the median kept: the machine is shared and noisy, so absolute times mean little. A key's pairs are
spread over the module's whole run (`round_robin`).

  dual_context_overhead[_smollm2]  the user-facing cost: ReDuMix mixture decode time per token (2B rows, x and a
                              longer x2) / plain decode time per token on x (B rows), batch 8. Reported, no goal on
                              a CPU: where a forward costs its rows (compute-bound) it is ≈2 plus the waste below;
                              where it costs its call (a small model, a GPU's latency-bound decode) it nears 1.
                              The paper reports ≈1.7 on GPUs.
  baseline_vs_hf_generate_{shape}_b{B}  our decoder's tokens/s / `model.generate`'s (greedy, same length), at
                              batch 1 and 16, on both shapes. Goal ≥ 1; floor ≈1.0 (see the function).
  batched_harvest_speedup     ReDuMix examples/s at batch 16 / examples/s one at a time. Ceiling ≈16 where a
                              forward costs its call (a small model here, or a GPU's decode), ≈1 where it costs
                              its rows (a large model on a CPU).
  shard_bytes_per_token       shard bytes on disk / redo tokens, at k=32 (plus the KL of the stored top-k). Raw,
                              a token is 32 ids (int32) + 32 log-probs (float16) + tail, id and offsets ≈ 204
                              bytes; the shard's compression takes it below that, on any hardware.
  redo_vs_hf_cfg_{shape}_b{B}  the ReDuMix redo's tokens/s, ours over transformers' own implementation of the same
                              maths, `generate(x, guidance_scale=λ, negative_prompt_ids=x2)`, each as it really
                              runs: ours extends the caches that stages 1-3 built (x2 is never re-encoded), while
                              transformers prefills x2 from scratch and runs its second context as a separate,
                              unbatched forward. Goal ≥ 1.5 at batch 16. Floor: on a compute-bound CPU ≈1.0 plus
                              what the x2 prefill costs them; on a GPU, where one 2B-row forward costs about what a
                              B-row one does, up to ≈2 plus the prefill.
  mixture_waste[_smollm2]     the mixture loop's time for B examples (2B rows: x and x2) / a plain decode loop's
                              over the same 2B rows with the same cache lengths and steps: what mixing, top-k,
                              the tail and the bookkeeping add to the forwards that cannot be avoided. Batch 16.
                              Goal ≤ 1.15; floor 1.0 on a CPU and on a GPU alike.

The models are bench/models.py's, seed-built, never what lies in runs/: the embedded default's shape and
SmolLM2-135M's (random weights).
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.models import describe, embedded_model, embedded_tokenizer, smollm2_shape_model
from redumix.data.chat import prompt_ids
from redumix.data.prompts import attempt_messages, redo_messages
from redumix.data.shards import encode_shard, read_shard
from redumix.data.tasks import TaskConfig, make_task
from redumix.generate.hf_engine import HfEngine
from redumix.generate.mixture import mixture_loop
from redumix.generate.plain import generate_batch, sample_loop
from redumix.generate.policy import SamplingPolicy
from redumix.generate.redumix import RedumixConfig, redumix_generate
from redumix.generate.state import clone, merge, prefill

TOKENS = 48
TASK = make_task(TaskConfig(), seed=0)


def load() -> tuple[torch.nn.Module, object, str]:
    tokenizer = embedded_tokenizer()
    model = embedded_model(tokenizer)
    return model, tokenizer, describe(model)


@dataclass
class Pairs:
    """One key's two sides. Its ratio is the median of numerator() / denominator() over `pairs` pairs, the two
    timings of a pair taken one right after the other."""

    numerator: Callable[[], float]
    denominator: Callable[[], float]
    pairs: int = 5
    warmed: bool = False  # the caller has run both sides once already, more cheaply than a full call


# On a shared host the same call's time drifts over tens of seconds, and not by the same factor on both sides, so
# pairs taken back to back sample one such stretch and two runs can disagree on a key (docs/measurements.md, "Bench
# noise"). Spread over `ROUNDS` passes through every key, each key samples the same mix of stretches as the others
# do, and as it does in another run.
ROUNDS = 3


def round_robin(keys: dict[str, Pairs], rounds: int = ROUNDS, label: str = "bench") -> dict[str, float]:
    """Each key's median pair ratio, its pairs dealt out over `rounds` passes through all the keys."""
    began = time.perf_counter()
    for pair in keys.values():
        if not pair.warmed:
            pair.numerator(), pair.denominator()
    ratios: dict[str, list[float]] = {key: [] for key in keys}
    for done in range(rounds):
        for key, pair in keys.items():
            for _ in range(pair.pairs // rounds + (done < pair.pairs % rounds)):
                ratios[key].append(pair.numerator() / pair.denominator())
        if rounds > 1:
            print(f"{label}: round {done + 1} of {rounds} at {time.perf_counter() - began:.0f} s", flush=True)
    return {key: statistics.median(found) for key, found in ratios.items()}


def median_ratio(
    numerator: Callable[[], float], denominator: Callable[[], float], repeats: int = 5, warmup: bool = True
) -> float:
    """Median of numerator()/denominator() over `repeats` pairs taken now (a warm-up pair first, unless the caller
    has warmed both up more cheaply)."""
    return round_robin({"": Pairs(numerator, denominator, repeats, warmed=not warmup)}, rounds=1)[""]


# A timing shorter than this is repeated until it is not, and averaged: single calls of the embedded model at batch 1
# are too short to time alike in two runs on a shared host (docs/measurements.md, "Bench noise").
MIN_SECONDS = 1.0


def timed(fn: Callable[[], object], min_seconds: float = MIN_SECONDS) -> float:
    """Seconds per call of `fn`: once, or as many times as fill `min_seconds`."""
    calls, began = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - began
        if elapsed >= min_seconds:
            return elapsed / calls


def prompts(tokenizer, n: int) -> list[list[int]]:
    examples = TASK.examples("test", n)
    return [prompt_ids(tokenizer, attempt_messages(e.prompt)) for e in examples]


def dual_context_overhead(model, tokenizer, batch: int = 8, repeats: int = 5) -> Pairs:
    """Per-token cost of the mixture loop (2B rows; x2 longer than x) against the plain loop on x (B rows)."""
    xs = prompts(tokenizer, batch)
    x2s = [x + x[1:] + x[1:] for x in xs]  # a longer second context, as x2 is
    policy = SamplingPolicy(max_new_tokens=TOKENS)
    seeds = torch.arange(batch)
    pad = tokenizer.pad_token_id
    x_state, x2_state = prefill(model, xs, pad), prefill(model, x2s, pad)

    def plain() -> float:
        return timed(lambda: generate_batch(model, xs, policy, seeds.tolist(), [], pad)) - timed(
            lambda: prefill(model, xs, pad))

    def mixture() -> float:
        return timed(lambda: mixture_loop(model, clone(x_state), clone(x2_state), 0.5, 32, policy, seeds, []))

    return Pairs(mixture, plain, repeats)


def baseline_vs_hf_generate(model, tokenizer, batch: int, repeats: int = 5) -> Pairs:
    """Goal ≥ 1: plain decoding never slower than the library. Both sides run the same forwards (one prefill, then
    one B-row token per step, TOKENS steps), so the floor is ≈1.0 on a CPU and on a GPU alike; ours gains what it
    saves per step (a growing cache instead of a torch.cat of the whole cache, fewer Python calls: no logits
    processors or stopping criteria), which shows where a step is cheap: a small model, or a GPU's latency-bound
    decode."""
    xs = prompts(tokenizer, batch)
    pad = tokenizer.pad_token_id
    policy = SamplingPolicy(max_new_tokens=TOKENS)
    padded = tokenizer.pad({"input_ids": xs}, return_tensors="pt", padding_side="left")

    def ours() -> float:
        return timed(lambda: generate_batch(model, xs, policy, list(range(batch)), [], pad))

    def hf() -> float:
        return timed(lambda: model.generate(**padded, max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False,
                                            pad_token_id=pad))

    return Pairs(hf, ours, repeats)  # time ratio hf/ours == tokens/s ratio ours/hf


# A realistic x2: the attempt, verifier feedback and a long-hand reflection make it several times x.
ATTEMPT = "12 + 7 = 19\n19 * 3 = 56\n56 - 8 = 48\nThe answer is 48."
FEEDBACK = "Your final answer 48 is wrong."
REFLECTION = ("I check each line the long way.\nLine 1: 12 + 7: 10 + 0 = 10, 2 + 7 = 9, 10 + 9 = 19. Right.\n"
              "Line 2: 19 * 3: 10 * 3 = 30, 9 * 3 = 27, 30 + 27 = 57. Wrong, I wrote 56.\n"
              "Line 3: 57 - 8: 57 - 7 = 50, 50 - 1 = 49. Wrong, I wrote 48.")


def redo_vs_hf_cfg(model, tokenizer, batch: int, lam: float = 0.5, tokens: int = 32, repeats: int = 3) -> Pairs:
    examples = TASK.examples("test", batch)
    xs = [prompt_ids(tokenizer, attempt_messages(e.prompt)) for e in examples]
    x2s = [prompt_ids(tokenizer, redo_messages(e.prompt, ATTEMPT, FEEDBACK, REFLECTION)) for e in examples]
    pad = tokenizer.pad_token_id
    policy = SamplingPolicy(max_new_tokens=tokens)
    seeds = torch.arange(batch)
    x_state, x2_state = prefill(model, xs, pad), prefill(model, x2s, pad)  # built by stages 1-3 in a harvest
    x = tokenizer.pad({"input_ids": xs}, return_tensors="pt", padding_side="left")
    x2 = tokenizer.pad({"input_ids": x2s}, return_tensors="pt", padding_side="left")

    def ours() -> float:
        return timed(lambda: mixture_loop(model, clone(x_state), clone(x2_state), lam, 32, policy, seeds, []))

    def theirs() -> float:
        return timed(lambda: model.generate(
            **x, guidance_scale=lam, negative_prompt_ids=x2["input_ids"],
            negative_prompt_attention_mask=x2["attention_mask"], max_new_tokens=tokens, min_new_tokens=tokens,
            do_sample=False, pad_token_id=pad))

    return Pairs(theirs, ours, repeats)  # time ratio theirs/ours == tokens/s ratio ours/theirs


def mixture_waste(model, tokenizer, batch: int = 16, tokens: int = 32, repeats: int = 3) -> Pairs:
    examples = TASK.examples("test", batch)
    xs = [prompt_ids(tokenizer, attempt_messages(e.prompt)) for e in examples]
    x2s = [prompt_ids(tokenizer, redo_messages(e.prompt, ATTEMPT, FEEDBACK, REFLECTION)) for e in examples]
    pad = tokenizer.pad_token_id
    policy = SamplingPolicy(max_new_tokens=tokens)
    x_state, x2_state = prefill(model, xs, pad), prefill(model, x2s, pad)
    both = merge([x_state, x2_state])  # the same 2B rows and cache lengths the mixture loop decodes

    def mixture() -> float:
        return timed(lambda: mixture_loop(model, clone(x_state), clone(x2_state), 0.5, 32, policy,
                                          torch.arange(batch), []))

    def plain() -> float:
        return timed(lambda: sample_loop(model, clone(both), policy, torch.arange(2 * batch), []))

    return Pairs(mixture, plain, repeats)


def batched_harvest_speedup(model, tokenizer, n: int = 16) -> Pairs:
    examples = TASK.examples("train", n)
    config = RedumixConfig(reflection_max_tokens=96)
    policy = SamplingPolicy(max_new_tokens=64)
    engine = HfEngine(model, tokenizer)

    def run(batch: int) -> float:
        def go():
            for start in range(0, n, batch):
                part = examples[start : start + batch]
                redumix_generate(engine, [e.prompt for e in part], [e.id for e in part], config, policy, 0,
                                 lambda i, a, part=part: TASK.feedback(a, part[i]))
        return timed(go)

    # The b16 side is short and moves with the host's noise: the median of 5 pairs (docs/measurements.md).
    return Pairs(lambda: run(1), lambda: run(16), 5)  # time at b1 / time at b16 == speedup


def shard_bytes_per_token(model, tokenizer, n: int = 64) -> tuple[float, float]:
    """Bytes per redo token of a real shard at k=32, and the max KL between stored and exact top-k + tail."""
    examples = TASK.examples("train", n)
    config = RedumixConfig(topk=32)
    policy = SamplingPolicy(max_new_tokens=96, temperature=1.0)
    rows = []
    for start in range(0, n, 16):
        part = examples[start : start + 16]
        results = redumix_generate(HfEngine(model, tokenizer), [e.prompt for e in part], [e.id for e in part], config,
                                   policy, 0, lambda i, a, part=part: TASK.feedback(a, part[i]))
        for e, r in zip(part, results, strict=True):
            rows.append({"id": e.id, "task": e.task, "prompt": e.prompt, "reference": e.reference,
                         "original": r.original, "original_correct": None, "feedback": r.feedback,
                         "reflection": r.reflection, "redo": r.redo, "redo_correct": None,
                         "redo_token_ids": r.redo_token_ids, "mix_topk_ids": r.topk_ids,
                         "mix_topk_logprobs": r.topk_logprobs, "mix_tail_logprob": r.tail_logprobs,
                         "lam": 0.5, "meta": r.meta})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shard-00000.arrow"
        path.write_bytes(encode_shard(rows))
        size = path.stat().st_size
        table = read_shard(path)
        stored = zip(table.column("mix_topk_logprobs").to_pylist(), table.column("mix_tail_logprob").to_pylist(),
                     strict=True)
    tokens = sum(len(r["redo_token_ids"]) for r in rows)
    worst = 0.0
    for row, (topk_back, tail_back) in zip(rows, stored, strict=True):
        steps = zip(row["mix_topk_logprobs"], row["mix_tail_logprob"], topk_back, tail_back, strict=True)
        for exact, exact_tail, approx, approx_tail in steps:
            worst = max(worst, _kl_with_tail(exact, exact_tail, approx, approx_tail))
    return size / tokens, worst


def _kl_with_tail(exact: list[float], exact_tail: float, approx: list[float], approx_tail: float) -> float:
    """KL(exact ‖ stored) over the top-k entries plus the tail bucket, the stored side renormalised as the loss
    renormalises it. `exact` is p_mix in float32 with its logsumexp tail; `approx` is what the shard holds."""
    p = [math.exp(v) for v in exact] + [math.exp(exact_tail)]
    q = [math.exp(v) for v in approx] + [math.exp(approx_tail)]
    q_total = math.fsum(q)
    return math.fsum(a * math.log(a * q_total / b) for a, b in zip(p, q, strict=True) if a > 0)


def run() -> dict[str, float | str]:
    torch.set_num_threads(2)
    model, tokenizer, source = load()
    smollm2 = smollm2_shape_model()
    bytes_per_token, kl = shard_bytes_per_token(model, tokenizer)
    keys = {
        "dual_context_overhead": dual_context_overhead(model, tokenizer, repeats=9),
        "dual_context_overhead_smollm2": dual_context_overhead(smollm2, tokenizer, repeats=3),
        "baseline_vs_hf_generate_embedded_b1": baseline_vs_hf_generate(model, tokenizer, 1),
        "baseline_vs_hf_generate_embedded_b16": baseline_vs_hf_generate(model, tokenizer, 16),
        "baseline_vs_hf_generate_smollm2_b1": baseline_vs_hf_generate(smollm2, tokenizer, 1, repeats=3),
        "baseline_vs_hf_generate_smollm2_b16": baseline_vs_hf_generate(smollm2, tokenizer, 16, repeats=4),
        "batched_harvest_speedup": batched_harvest_speedup(model, tokenizer),
        # 6 pairs at the embedded shape, where a pair is cheap; 3 at SmolLM2's, where it costs many times more.
        "redo_vs_hf_cfg_embedded_b1": redo_vs_hf_cfg(model, tokenizer, 1, repeats=6),
        "redo_vs_hf_cfg_embedded_b16": redo_vs_hf_cfg(model, tokenizer, 16, repeats=6),
        "redo_vs_hf_cfg_smollm2_b1": redo_vs_hf_cfg(smollm2, tokenizer, 1),
        "redo_vs_hf_cfg_smollm2_b16": redo_vs_hf_cfg(smollm2, tokenizer, 16),
        "mixture_waste": mixture_waste(model, tokenizer, repeats=9),
        "mixture_waste_smollm2": mixture_waste(smollm2, tokenizer),
    }
    ratios = round_robin(keys, label="bench_decode")
    return {
        "decode_model": source,
        **{key: round(ratio, 3) for key, ratio in ratios.items()},
        "shard_bytes_per_token": round(bytes_per_token, 2),
        "shard_max_kl_vs_exact_topk": kl,
        "redo_x2_over_x_tokens": round(_x2_over_x(tokenizer), 2),
    }


def _x2_over_x(tokenizer) -> float:
    e = TASK.examples("test", 1)[0]
    return (len(prompt_ids(tokenizer, redo_messages(e.prompt, ATTEMPT, FEEDBACK, REFLECTION)))
            / len(prompt_ids(tokenizer, attempt_messages(e.prompt))))
