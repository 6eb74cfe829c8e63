"""Mixture of Inputs (Zhuang et al., "Text Generation Beyond Discrete Token Sampling").

After sampling token s from p (the policy's distribution renormalised over its top-k), the next input is not e_s
but the posterior mean Σ_i w_i·e_i with w = (H·p + (β+1−H)·onehot(s)) / (β+1), where H is p's entropy over log k.
A confident step (H≈0) feeds e_s as plain decoding does; an uncertain one blends in the tokens it nearly chose.

The mixed embedding replaces the sampled token's embedding at the same position, so MoI costs no extra forward
passes: its FPE equals plain decoding's. It runs the shared decode loop, feeding `inputs_embeds` instead of ids.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from redumix.data.task import Example, Task
from redumix.generate.decoder import Decoded, answer_directly
from redumix.generate.engine import Engine
from redumix.generate.hf_engine import hf_parts
from redumix.generate.loop import Choice, Generation, decode_prompts
from redumix.generate.policy import SamplingPolicy, policy_logprobs, sample_tokens


@dataclass
class MoiConfig:
    beta: float = field(default=1.0, metadata={"help": "Concentration β: larger trusts the sampled token more."})
    topk: int = field(default=20, metadata={"help": "p is the policy renormalised over its top-k tokens."})

    def __post_init__(self) -> None:
        problems = []
        if self.beta < 0:
            problems.append(f"beta must be >= 0, got {self.beta}")
        if self.topk < 1:
            problems.append(f"topk must be >= 1, got {self.topk}")
        if problems:
            raise ValueError("; ".join(problems))


def moi_weights(p: torch.Tensor, top_ids: torch.Tensor, sampled: torch.Tensor, beta: float) -> torch.Tensor:
    """w [B, k] over the ids `top_ids` [B, k], from p [B, k] (sums to 1) and the sampled ids [B] (inside top_ids)."""
    k = p.shape[-1]
    entropy = -torch.where(p > 0, p * p.clamp_min(1e-30).log(), torch.zeros_like(p)).sum(dim=-1, keepdim=True)
    # With k = 1 p is one-hot and has no entropy to normalise.
    normalised = entropy / math.log(k) if k > 1 else torch.zeros_like(entropy)
    onehot = (top_ids == sampled[:, None]).to(p.dtype)
    return (normalised * p + (beta + 1 - normalised) * onehot) / (beta + 1)


def moi_step(
    logits: torch.Tensor,
    embedding: torch.Tensor,
    policy: SamplingPolicy,
    seeds: torch.Tensor,
    step: int,
    config: MoiConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from the top-k policy distribution; return (tokens [B], next inputs [B, D])."""
    logprobs = policy_logprobs(logits, policy)
    k = min(config.topk, logprobs.shape[-1])
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    top_logprobs = torch.log_softmax(top_logprobs, dim=-1)
    # Sample over the full vocabulary so the hashed noise is indexed by token id, as in plain decoding: when the
    # policy's own support fits in the top-k, MoI samples exactly the tokens plain decoding would.
    restricted = torch.full_like(logprobs, float("-inf")).scatter(-1, top_ids, top_logprobs)
    tokens = sample_tokens(restricted, policy, seeds, step)
    weights = moi_weights(top_logprobs.exp(), top_ids, tokens, config.beta)
    mixed = torch.einsum("bk,bkd->bd", weights, embedding[top_ids].float())
    return tokens, mixed.to(embedding.dtype)


def moi_generate(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    policy: SamplingPolicy,
    seeds: Sequence[int],
    stop_ids: Sequence[int],
    pad_id: int,
    config: MoiConfig,
    max_new_tokens: int | None = None,
) -> list[Generation]:
    """Decode a batch of prompts with Mixture of Inputs; same accounting as `generate_batch`."""
    embedding = model.get_input_embeddings().weight
    assert isinstance(embedding, torch.Tensor)  # typed Tensor | Module by torch's Module.__getattr__
    seeds_t = torch.as_tensor(list(seeds))

    def choose(logits: torch.Tensor, live: torch.Tensor, step: int) -> Choice:
        tokens, mixed = moi_step(logits, embedding, policy, seeds_t.to(live.device)[live], step, config)
        return Choice(tokens, inputs_embeds=mixed)

    return decode_prompts(model, prompts, choose, stop_ids, pad_id, max_new_tokens or policy.max_new_tokens)


@dataclass
class MoiDecoder:
    """`moi`: plain decoding whose next input is the posterior-weighted embedding mix."""

    name: str
    config: MoiConfig
    policy: SamplingPolicy
    seed: int

    needs_hf_engine = True  # it feeds embedding mixes, not tokens

    def __call__(self, engine: Engine, examples: Sequence[Example], task: Task) -> list[Decoded]:
        model, tokenizer = hf_parts(engine)

        def answer(prompts, seeds):
            return moi_generate(model, prompts, self.policy, seeds, engine.stop_ids, tokenizer.pad_token_id,
                                self.config)

        return answer_directly(answer, engine, examples, self.seed, self.name)
