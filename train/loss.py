"""Generalized JSD between the student and a stored sparse teacher: top-k ids plus one tail bucket.

TRL's `generalized_jsd_loss` needs the teacher's full logits. The harvest stores only the top-k of p_mix, so the
divergence here is taken over k+1 buckets: the k stored ids, and a tail that holds the teacher's leftover mass
against the student's mass outside those ids. The harvest stores that leftover exactly (`mix_tail_logprob`, the
log of the mass outside the top-k, a logsumexp over the other ids); shards from before it fall back to
1 − Σ exp(top-k), which float16 log-probs make imprecise when the tail is small. Nothing of the stored distribution
is lost, and with k equal to the vocabulary the tail is empty and the loss equals TRL's (tests/test_train_loss.py).

Conventions follow TRL: β=0 is KL(teacher‖student) (forward KL, the seed's cross-entropy under the mixture up to a
constant), β=1 is KL(student‖teacher), and in between m = β·p + (1−β)·q with loss β·KL(p‖m) + (1−β)·KL(q‖m).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# A bucket with no mass (a padding slot of a short top-k row, or a student tail over an empty complement) gets this
# finite log-prob instead of -inf: exp() is exactly 0, and no 0·inf can turn a gradient into NaN.
EMPTY_LOG = -1.0e4
# Stored teacher log-probs are floored here. A teacher tail of exactly 0 is usually float16 rounding of a top-k that
# sums to 1; without a floor, reverse KL would be infinite for any student tail mass.
TEACHER_LOG_FLOOR = math.log(1e-12)


def sparse_teacher_buckets(
    topk_logprobs: torch.Tensor,
    temperature: float = 1.0,
    full_support: torch.Tensor | None = None,
    tail_logprob: torch.Tensor | None = None,
) -> torch.Tensor:
    """Teacher log-probs over k+1 buckets (top-k, tail), tempered and renormalised. Slots at -inf are padding.

    topk_logprobs: (N, k) float; full_support: (N,) bool, rows whose top-k covers the whole vocabulary, where the
    tail is empty whatever rounding left over; tail_logprob: (N,) the stored log tail mass (else 1 − Σp is used).
    Returns (N, k+1) float32.
    """
    logprobs = topk_logprobs.float()
    valid = torch.isfinite(logprobs)
    kept = torch.where(valid, logprobs.clamp_min(TEACHER_LOG_FLOOR), EMPTY_LOG)
    if tail_logprob is None:
        covered = torch.where(valid, logprobs.exp(), 0.0).sum(-1, keepdim=True)
        tail = torch.log((1.0 - covered).clamp_min(math.exp(TEACHER_LOG_FLOOR)))
    else:
        tail = tail_logprob.float().unsqueeze(-1).clamp_min(TEACHER_LOG_FLOOR)
    if full_support is not None:
        tail = tail.masked_fill(full_support.unsqueeze(-1), EMPTY_LOG)
    buckets = torch.cat([kept, tail], dim=-1) / temperature
    # Renormalising makes a top-k that rounds to more than 1 a distribution again, and applies the temperature.
    return F.log_softmax(buckets, dim=-1)


def sparse_student_buckets(
    student_logits: torch.Tensor, topk_ids: torch.Tensor, valid: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Student log-probs over the same k+1 buckets: its log-prob of each top-k id, then its mass on every other id.

    student_logits: (N, V); topk_ids: (N, k) int; valid: (N, k) bool.
    Returns (N, k+1) float32 log-probs and (N,) bool: the top-k covers the whole vocabulary (the tail is empty).
    """
    scaled = student_logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    # Padding slots point at the row's first id: a repeat of a real id changes neither the gather nor the tail.
    ids = torch.where(valid, topk_ids.long(), topk_ids[:, :1].long())
    buckets = _StudentBuckets.apply(scaled, ids, valid)
    full_support = _covers_vocabulary(ids, valid, scaled.shape[-1])
    tail = buckets[:, -1:].masked_fill(full_support.unsqueeze(-1), EMPTY_LOG)
    return torch.cat([buckets[:, :-1], tail], dim=-1), full_support


class _StudentBuckets(torch.autograd.Function):
    """log q over [top-k ids, tail] from logits, with a hand-written backward.

    Autograd through log_softmax + gather + a masked logsumexp makes about twice as many passes over the (N, V)
    logits as cross-entropy does; this keeps one saved softmax and one pass in backward, like cross-entropy.
    The tail is the sum of the softmax outside the top-k (exact, no 1 − Σp cancellation).
    d log q_i / dz_j = [j = i] − p_j for a top-k id i; d log q_tail / dz_j = [j ∉ K] p_j / q_tail − p_j.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        log_norm = torch.logsumexp(logits, dim=-1, keepdim=True)
        probs = torch.softmax(logits, dim=-1)
        in_topk = (logits.gather(-1, ids) - log_norm).masked_fill(~valid, EMPTY_LOG)
        outside = probs.scatter(-1, ids, 0.0).sum(-1, keepdim=True).clamp_min(1e-30)
        ctx.save_for_backward(probs, ids, valid, outside)
        return torch.cat([in_topk, outside.log()], dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN001
        probs, ids, valid, outside = ctx.saved_tensors
        grad_topk = grad[:, :-1] * valid
        grad_tail = grad[:, -1:]
        total = grad_topk.sum(-1, keepdim=True) + grad_tail
        # Every id first as if outside the top-k, then the top-k ids overwritten with their own value. A padding
        # slot repeats its row's first id, so it carries that slot's value and the scatter has no conflict.
        grad_logits = probs * (grad_tail / outside - total)
        at_topk = grad_topk - probs.gather(-1, ids) * total
        grad_logits.scatter_(-1, ids, torch.where(valid, at_topk, at_topk[:, :1]))
        return grad_logits, None, None


def _covers_vocabulary(ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Rows whose valid top-k ids are the whole vocabulary (only possible when k >= V, so usually skipped)."""
    if ids.shape[-1] < vocab_size:
        return torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    hits = torch.zeros(ids.shape[0], vocab_size, device=ids.device).scatter_add_(-1, ids, valid.float())
    return (hits > 0).all(-1)


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p‖q) summed over the last dimension; both are finite log-probs."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def generalized_jsd(student_log: torch.Tensor, teacher_log: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-position generalized JSD over matching buckets (TRL's definition). Returns (N,)."""
    if beta == 0.0:
        return _kl(teacher_log, student_log)
    if beta == 1.0:
        return _kl(student_log, teacher_log)
    mixture = torch.logaddexp(teacher_log + math.log(beta), student_log + math.log1p(-beta))
    return beta * _kl(teacher_log, mixture) + (1.0 - beta) * _kl(student_log, mixture)


def sparse_gkd_loss(
    student_logits: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    beta: float = 0.0,
    temperature: float = 1.0,
    num_items_in_batch: torch.Tensor | int | None = None,
    tail_logprob: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum of the per-token divergence over the N target tokens, divided by num_items_in_batch (else N).

    student_logits: (N, V), the logits that predict each target token (prompt and padding already dropped).
    topk_ids / topk_logprobs: (N, k), the stored top-k of p_mix at the same tokens; -inf log-probs mark padding.
    tail_logprob: (N,), the stored log mass outside the top-k (None for shards that predate it).
    Dividing by the count of target tokens in the whole accumulated batch (what HF Trainer passes as
    num_items_in_batch) makes the gradient the same whatever the gradient-accumulation split.
    """
    valid = torch.isfinite(topk_logprobs)
    student_log, full_support = sparse_student_buckets(student_logits, topk_ids, valid, temperature)
    teacher_log = sparse_teacher_buckets(topk_logprobs, temperature, full_support, tail_logprob)
    total = generalized_jsd(student_log, teacher_log, beta).sum()
    count = student_logits.shape[0] if num_items_in_batch is None else num_items_in_batch
    if isinstance(count, torch.Tensor):
        count = count.to(total.device)
    else:
        count = max(int(count), 1)
    return total / count


def select_targets(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits that predict each labelled token, in row-major order: (N, V), and those tokens: (N,).

    labels are unshifted (HF convention): labels[b, i] is the token at position i, -100 where nothing is learnt.
    The logits at position i-1 predict it.
    """
    shifted = labels[:, 1:]
    mask = shifted != -100
    return logits[:, :-1][mask], shifted[mask]
