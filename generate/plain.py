"""Plain decoding, greedy or sampled: the baseline every other decoder is judged against."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from redumix.data.prompts import attempt_messages, longhand_messages
from redumix.data.task import Example, Task
from redumix.generate.decoder import Decoded, answer_directly
from redumix.generate.engine import Engine
from redumix.generate.loop import Choice, ChooseFn, Generation, LoopResult, decode_loop, decode_prompts
from redumix.generate.policy import SamplingPolicy, policy_logprobs, sample_tokens
from redumix.generate.state import DecodeState


def plain_choice(policy: SamplingPolicy, seeds: torch.Tensor, banned_ids: Sequence[int] = ()) -> ChooseFn:
    """Argmax when greedy, else a policy sample with each example's own noise; `banned_ids` are never emitted."""
    banned = torch.as_tensor(list(banned_ids), dtype=torch.long)

    def choose(logits: torch.Tensor, live: torch.Tensor, step: int) -> Choice:
        if banned.numel():
            logits = logits.index_fill(1, banned.to(logits.device), float("-inf"))
        if policy.greedy:
            return Choice(logits.argmax(dim=-1))
        live_seeds = seeds.to(live.device)[live]
        return Choice(sample_tokens(policy_logprobs(logits, policy), policy, live_seeds, step))

    return choose


def sample_loop(
    model: PreTrainedModel,
    state: DecodeState,
    policy: SamplingPolicy,
    seeds: torch.Tensor,
    stop_ids: Sequence[int],
    max_new_tokens: int | None = None,
    banned_ids: Sequence[int] = (),
    keep_state: bool = False,
) -> LoopResult:
    """Plain decoding of every row of `state` (see `decode_loop` for keep_state)."""
    choose = plain_choice(policy, seeds, banned_ids)
    return decode_loop(model, state, choose, stop_ids, max_new_tokens or policy.max_new_tokens, keep_state=keep_state)


def generate_batch(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    policy: SamplingPolicy,
    seeds: Sequence[int],
    stop_ids: Sequence[int],
    pad_id: int,
    max_new_tokens: int | None = None,
    banned_ids: Sequence[int] = (),
) -> list[Generation]:
    """Plain decoding (greedy or sampled) of a batch of prompts."""
    choose = plain_choice(policy, torch.as_tensor(list(seeds)), banned_ids)
    return decode_prompts(model, prompts, choose, stop_ids, pad_id, max_new_tokens or policy.max_new_tokens)


@dataclass
class PlainDecoder:
    """`greedy` (temperature 0) or `sample`: the model answers x directly. `longhand` asks it, in the same turn, to
    work the long way (the careful procedure its reflections use): the visible long-hand CoT baseline."""

    name: str
    policy: SamplingPolicy
    seed: int
    longhand: bool = False

    needs_hf_engine = False

    def __call__(self, engine: Engine, examples: Sequence[Example], task: Task) -> list[Decoded]:
        messages = longhand_messages if self.longhand else attempt_messages
        return answer_directly(lambda prompts, seeds: engine.sample(prompts, seeds, self.policy), engine, examples,
                               self.seed, self.name, messages)
