"""The sparse generalized JSD against its definitions and against TRL's dense loss."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from trl.experimental.gkd import GKDTrainer

from redumix.train.loss import select_targets, sparse_gkd_loss


def _dense_as_sparse(teacher_logits: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """k = vocabulary: every id, with the teacher's log-probs, sorted descending like the harvest stores them."""
    logprobs = F.log_softmax(teacher_logits, dim=-1)
    values, ids = logprobs.sort(dim=-1, descending=True)
    return ids, values


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_full_vocabulary_equals_trl(beta: float, temperature: float) -> None:
    torch.manual_seed(0)
    batch, length, vocab = 3, 7, 31
    student = torch.randn(batch, length, vocab, dtype=torch.float64).float() * 2
    teacher = torch.randn(batch, length, vocab) * 2
    labels = torch.randint(0, vocab, (batch, length))
    labels[0, :3] = -100  # a prompt
    labels[2, 5:] = -100  # padding
    expected = GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta, temperature=temperature)
    mask = labels != -100
    ids, logprobs = _dense_as_sparse(teacher)
    # TRL tempers the teacher's logits; ours tempers its stored log-probs, which differ by a per-row constant.
    got = sparse_gkd_loss(student[mask], ids[mask], logprobs[mask], beta=beta, temperature=temperature)
    assert got.item() == pytest.approx(expected.item(), abs=1e-5)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_identical_distributions_give_zero(beta: float) -> None:
    torch.manual_seed(1)
    student = torch.randn(10, 40)
    logprobs = F.log_softmax(student, dim=-1)
    values, ids = logprobs.topk(6, dim=-1)  # k < V: the tails are equal too
    loss = sparse_gkd_loss(student, ids, values, beta=beta)
    assert abs(loss.item()) < 1e-6


def test_tail_bucket_by_hand() -> None:
    """V = 4, k = 2. Teacher top-2 {0: 0.5, 1: 0.3} (tail 0.2); student uniform (tail 0.5)."""
    student = torch.zeros(1, 4)
    ids = torch.tensor([[0, 1]])
    logprobs = torch.log(torch.tensor([[0.5, 0.3]]))
    forward = sum(p * math.log(p / q) for p, q in [(0.5, 0.25), (0.3, 0.25), (0.2, 0.5)])
    assert sparse_gkd_loss(student, ids, logprobs, beta=0.0).item() == pytest.approx(forward, abs=1e-6)
    reverse = sum(q * math.log(q / p) for p, q in [(0.5, 0.25), (0.3, 0.25), (0.2, 0.5)])
    assert sparse_gkd_loss(student, ids, logprobs, beta=1.0).item() == pytest.approx(reverse, abs=1e-6)
    # Without the tail (renormalised top-k only) the value would differ: the tail matters.
    no_tail = sum(p * math.log(p / q) for p, q in [(0.625, 0.5), (0.375, 0.5)])
    assert abs(forward - no_tail) > 0.05


def test_padding_slots_and_reduction() -> None:
    """A -inf slot is "no bucket"; num_items_in_batch replaces the local token count."""
    torch.manual_seed(2)
    student = torch.randn(4, 12)
    values, ids = F.log_softmax(torch.randn(4, 12), dim=-1).topk(3, dim=-1)
    padded_ids = torch.cat([ids, torch.zeros(4, 2, dtype=torch.long)], dim=-1)
    padded_values = torch.cat([values, torch.full((4, 2), float("-inf"))], dim=-1)
    plain = sparse_gkd_loss(student, ids, values, beta=0.5)
    padded_loss = sparse_gkd_loss(student, padded_ids, padded_values, beta=0.5)
    assert padded_loss.item() == pytest.approx(plain.item(), abs=1e-6)
    assert sparse_gkd_loss(student, ids, values, beta=0.5, num_items_in_batch=8).item() == pytest.approx(
        plain.item() / 2, abs=1e-6
    )


def test_gradients_are_finite_at_extremes() -> None:
    """A teacher top-k summing to 1 (tail 0) under reverse KL, and k = V, must not give NaN gradients."""
    student = torch.randn(2, 5, requires_grad=True)
    ids = torch.tensor([[0, 1, 2, 3, 4], [4, 3, 2, 1, 0]])
    logprobs = torch.log(torch.tensor([[0.6, 0.4, 0.0, 0.0, 0.0], [0.2] * 5])).clamp_min(-float("inf"))
    for beta in (0.0, 0.5, 1.0):
        student.grad = None
        sparse_gkd_loss(student, ids[:, :2], logprobs[:, :2], beta=beta).backward()
        assert torch.isfinite(student.grad).all()
        student.grad = None
        sparse_gkd_loss(student, ids, torch.log(torch.full((2, 5), 0.2)), beta=beta).backward()
        assert torch.isfinite(student.grad).all()


def test_select_targets_shifts() -> None:
    logits = torch.arange(2 * 4 * 3, dtype=torch.float).view(2, 4, 3)
    labels = torch.tensor([[-100, -100, 2, 1], [-100, 0, -100, -100]])
    selected, tokens = select_targets(logits, labels)
    assert tokens.tolist() == [2, 1, 0]
    assert torch.equal(selected, torch.stack([logits[0, 1], logits[0, 2], logits[1, 0]]))


def _reverse_kl_float64(student_logits: torch.Tensor, teacher_probs: torch.Tensor, ids: torch.Tensor) -> float:
    """KL(student ‖ teacher) over [top-k ids, tail] from the exact distributions, in float64."""
    q = torch.softmax(student_logits.double(), dim=-1)
    q_top, p_top = q.gather(-1, ids), teacher_probs.gather(-1, ids)
    q_b = torch.cat([q_top, 1 - q_top.sum(-1, keepdim=True)], -1)
    p_b = torch.cat([p_top, teacher_probs.sum(-1, keepdim=True) - p_top.sum(-1, keepdim=True)], -1)
    return float((q_b * (q_b / p_b).log()).sum(-1).mean())


@pytest.mark.parametrize("tail", [1e-4, 1e-6, 1.5e-7, 1e-8])
def test_reverse_kl_with_the_stored_tail_matches_float64(tail: float) -> None:
    """Stored as the harvest stores it (float16 top-k; the tail a float32 logsumexp over float32 log p_mix, as
    `mixture_topk` takes it), β=1 matches the float64 loss to 1e-4."""
    gen = torch.Generator().manual_seed(0)
    vocab, k, rows = 64, 8, 16
    top = torch.rand(rows, k, generator=gen, dtype=torch.float64) + 0.1
    top = top / top.sum(-1, keepdim=True) * (1 - tail)
    rest = torch.rand(rows, vocab - k, generator=gen, dtype=torch.float64)
    rest = rest / rest.sum(-1, keepdim=True) * tail
    teacher = torch.cat([top, rest], -1)  # ids 0..k-1 are the top-k
    ids = torch.arange(k).expand(rows, k)
    values, order = teacher.gather(-1, ids).log().sort(-1, descending=True)
    ids = ids.gather(-1, order)
    stored_topk = values.half().float()
    stored_tail = torch.logsumexp(teacher.log().float().scatter(-1, ids, float("-inf")), -1)
    student = torch.randn(rows, vocab, generator=gen)

    exact = _reverse_kl_float64(student, teacher, ids)
    ours = sparse_gkd_loss(student, ids, stored_topk, beta=1.0, tail_logprob=stored_tail).item()
    assert ours == pytest.approx(exact, rel=1e-4)
    # The fallback (1 − Σ exp(float16)) is what the stored tail replaces: far off once the tail is small.
    if tail <= 1.5e-7:
        fallback = sparse_gkd_loss(student, ids, stored_topk, beta=1.0).item()
        assert abs(fallback - exact) / exact > 1e-3
