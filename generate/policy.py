"""The sampling policy every decoder shares, and batch-independent sampling.

Sampling draws its randomness from a counter-based hash of (example seed, step, token id) instead of a stateful
generator. A row therefore samples the same text whatever else is in its batch, on whichever rank, and after a
resume: the harvest's crash-safety and its multi-process union both rely on that. The seed is the run's one seed
(`Config.seed`); each example derives its own from it with `example_seed`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_MASK31 = (1 << 31) - 1


@dataclass
class SamplingPolicy:
    temperature: float = field(default=0.0, metadata={"help": "0 decodes greedily; otherwise softmax temperature."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus mass kept before sampling (1 keeps all)."})
    top_k: int = field(default=0, metadata={"help": "Keep only the k most likely tokens (0 keeps all)."})
    max_new_tokens: int = field(default=160, metadata={"help": "Most tokens generated per answer."})

    def __post_init__(self) -> None:
        problems = []
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def policy_logprobs(logits: torch.Tensor, policy: SamplingPolicy) -> torch.Tensor:
    """Log-probs of the distribution the policy samples from: temperature, then top-k, then top-p, renormalised.

    Greedy (temperature 0) keeps the untempered distribution; its argmax is what is emitted either way.
    """
    logits = logits.float()
    if not policy.greedy:
        logits = logits / policy.temperature
    if policy.top_k and policy.top_k < logits.shape[-1]:
        kth = torch.topk(logits, policy.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logprobs = torch.log_softmax(logits, dim=-1)
    if policy.top_p < 1:
        sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_lp.exp(), dim=-1) - sorted_lp.exp()
        drop_sorted = mass_before >= policy.top_p  # the token that crosses top_p is kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logprobs = torch.log_softmax(logprobs.masked_fill(drop, float("-inf")), dim=-1)
    return logprobs


def example_seed(global_seed: int, example_id: str) -> int:
    """A stable 31-bit seed per example id (Python's hash() is salted per process, so it cannot be used)."""
    h = 2166136261
    for byte in f"{global_seed}:{example_id}".encode():
        h = ((h ^ byte) * 16777619) & 0xFFFFFFFF
    return h & _MASK31


def _hash31(x: torch.Tensor) -> torch.Tensor:
    """Hashes `x` in place. Multiply-xorshift rounds kept below 2**62 so int64 arithmetic never overflows; in place
    because at a real vocabulary every new [B, V] int64 tensor is megabytes to allocate and fill."""
    for constant in (0x5BD1E995, 0x27D4EB2F, 0x165667B1):
        x ^= x >> 15
        x *= constant
        x &= _MASK31
    x ^= x >> 13
    return x


def uniform_noise(seeds: torch.Tensor, step: int | torch.Tensor, vocab_size: int) -> torch.Tensor:
    """U(0,1) noise [B, V], a pure function of (seed, step, token id)."""
    device = seeds.device
    ids = torch.arange(vocab_size, device=device, dtype=torch.int64)
    step_t = torch.as_tensor(step, device=device, dtype=torch.int64).reshape(-1, 1)
    key = (seeds.to(torch.int64).reshape(-1, 1) * 0x01000193 + step_t * 0x0019660D) & _MASK31
    x = _hash31((key + ids.reshape(1, -1) * 0x3C6EF35F).bitwise_and_(_MASK31))
    return x.to(torch.float64).add_(0.5).div_(float(1 << 31))


def sample_tokens(
    logprobs: torch.Tensor, policy: SamplingPolicy, seeds: torch.Tensor, step: int | torch.Tensor
) -> torch.Tensor:
    """One token per row from policy log-probs [B, V]: argmax when greedy, else Gumbel-max with per-row noise."""
    if policy.greedy:
        return logprobs.argmax(dim=-1)
    gumbel = uniform_noise(seeds, step, logprobs.shape[-1]).log_().neg_().log_().neg_()  # −log(−log u)
    return gumbel.add_(logprobs).argmax(dim=-1)
