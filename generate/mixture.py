"""p_mix, the per-token mixture of two contexts: p_mix = softmax(λ·log p(·|x, y<t) + (1−λ)·log p(·|x2, y<t)).

`mixture_topk` computes it from the two contexts' logits, with its top-k and the mass outside it; the harvest's redo
and the on-policy teacher (train/onpolicy.py) both call it, so the live target is the stored one. `mixture_loop`
decodes from it, both contexts of every example in one batched forward pass per token (2B rows: B for x, B for x2).
Policy filters (temperature, top-p, top-k) apply to the mixture, not to each context, so λ=1 reproduces plain
decoding exactly and λ=0 reproduces decoding from x2 exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch
from transformers import PreTrainedModel

from redumix.generate.loop import Choice, ChooseFn, Generation, decode_loop
from redumix.generate.policy import SamplingPolicy, policy_logprobs, sample_tokens
from redumix.generate.state import DecodeState, merge

T = TypeVar("T")


def mixture_topk(
    logits_x: torch.Tensor, logits_x2: torch.Tensor, lam: float, topk: int
) -> tuple[torch.Tensor, torch.return_types.topk, torch.Tensor]:
    """log p_mix from each context's logits (N, V), its top-k, and the log of its mass outside the top-k.

    The harvest's decode loop and the on-policy teacher (train/onpolicy.py, row by row, each row with its own λ) both
    call this, so the live target is the stored one. The tail is a logsumexp over the other ids, not 1 − Σp, which
    cancels when the top-k holds nearly all the mass.
    """
    logp_x, logp_x2 = torch.log_softmax(logits_x.float(), dim=-1), torch.log_softmax(logits_x2.float(), dim=-1)
    if lam in (0, 1):  # exact, and no 0·−inf = NaN: λ=1 is plain decoding from x, λ=0 from x2
        mix = logp_x if lam == 1 else logp_x2
    else:
        # In place on the fresh log-softmaxes, and not torch.lerp, whose a + w·(b − a) turns an id that both
        # contexts rule out (−inf) into NaN.
        mix = torch.log_softmax(logp_x.mul_(lam).add_(logp_x2.mul_(1 - lam)), dim=-1)
    top = torch.topk(mix, min(topk, mix.shape[-1]), dim=-1)
    # float32 is enough: logsumexp sums exp(v − max) ≤ 1, so its error is float32's relative one (~1e-7) whatever
    # the tail's size; float64 adds nothing over float32 inputs and is many times slower on a CPU, where its exp is
    # scalar (docs/measurements.md).
    rest = mix.scatter(-1, top.indices, float("-inf"))
    # A float32 exp whose result would be subnormal (argument < −87.3) takes a slow path on a CPU, and masked or
    # extreme logits fill the row with such terms at a large vocabulary. Raising those terms to e^−87 relative to the
    # largest changes the sum (≥ 1) by at most V·e^−87, far below float32's resolution; a row of −inf stays −inf.
    floor = rest.amax(dim=-1, keepdim=True) - 87.0
    tail = torch.logsumexp(rest.clamp_(min=floor), dim=-1)
    return mix, top, tail


def mixture_contexts(lam: float, x_context: T, x2_context: T) -> list[T]:
    """The contexts p_mix reads: both, or at λ = 0 or 1 the one it is exactly (`mixture_topk`), so that a loop
    decodes half the rows there."""
    return [x2_context] if lam == 0 else [x_context] if lam == 1 else [x_context, x2_context]


def mixture_choice(lam: float, topk: int, policy: SamplingPolicy, seeds: torch.Tensor) -> ChooseFn:
    """The mixture's choice rule over a batch of 2n rows (x's n, then x2's), or of n rows of the one context
    `mixture_contexts` keeps: the token drawn from p_mix, and p_mix's top-k ids, their log-probs and the tail logged.
    The dynamic loop and the static one (static_cache.py) share it."""

    def choose(logits: torch.Tensor, live: torch.Tensor, step: int | torch.Tensor) -> Choice:
        n = live.shape[0]  # rows 0..n-1 hold x and the last n x2; with one context they are the same rows
        mix, top, tail = mixture_topk(logits[:n], logits[-n:], lam, topk)
        if policy.greedy:
            tokens = mix.argmax(dim=-1)
        else:
            tokens = sample_tokens(policy_logprobs(mix, policy), policy, seeds.to(live.device)[live], step)
        return Choice(tokens, (top.indices, top.values, tail))

    return choose


def mixture_loop(
    model: PreTrainedModel,
    x_context: DecodeState,
    x2_context: DecodeState,
    lam: float,
    topk: int,
    policy: SamplingPolicy,
    seeds: torch.Tensor,
    stop_ids: Sequence[int],
    max_new_tokens: int | None = None,
) -> list[tuple[Generation, list[list[int]], list[list[float]], list[float]]]:
    """Decode B examples from the mixture of their two contexts, one batched forward of 2B rows per token (of B at
    λ = 0 or 1, where p_mix is one context's distribution).

    Returns, per example, the generation and, at every emitted token, the top-k ids and log-probs of p_mix and
    the log of its mass outside the top-k. That tail is a logsumexp over the other ids, not 1 − Σp:
    the difference cancels when the top-k holds nearly all the mass.
    """
    tokens = max_new_tokens or policy.max_new_tokens
    read = mixture_contexts(lam, x_context, x2_context)
    state = merge(read, room=tokens)  # the loop feeds at most tokens − 1 more
    result = decode_loop(model, state, mixture_choice(lam, topk, policy, seeds), stop_ids, tokens,
                         contexts=len(read))
    return [(gen, *logged) for gen, logged in zip(result.generations, result.logged, strict=True)]
