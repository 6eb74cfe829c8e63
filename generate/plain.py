"""Plain decoding, greedy or sampled: the baseline every other decoder is judged against."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from redumix.data.prompts import attempt_messages, longhand_messages
from redumix.data.task import Example, Task
from redumix.generate.decoder import Decoded, Model, Tokenizer, answer_directly
from redumix.generate.loop import Choice, ChooseFn, Generation, LoopResult, decode_loop, decode_prompts
from redumix.generate.model_io import (
    ModelConfig,
    folder_stop_ids,
    load_model,
    load_tokenizer,
    pick_device,
    stop_token_ids,
)
from redumix.generate.policy import SamplingPolicy, policy_logprobs, sample_tokens
from redumix.generate.state import DecodeState
from redumix.generate.vllm_engine import VllmEngine, VllmSettings


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
class PlainSampler:
    """Plain decoding of token-id prompts at one policy, on the engine a stage names: `generate(x_ids, seeds)`. Both
    engines draw a row's noise from its seed, so what a stage writes does not depend on which one decoded it."""

    tokenizer: Tokenizer
    stop_ids: list[int]
    generate: Callable[[list[list[int]], Sequence[int]], list[Generation]]
    close: Callable[[], None]


def plain_sampler(path: Path, model: ModelConfig, vllm: VllmSettings, engine: str, seed: int, policy: SamplingPolicy,
                  key: str) -> PlainSampler:
    """A `PlainSampler` over the checkpoint at `path`: redumix's loop on the Hugging Face model (`engine` "hf") or
    a `VllmEngine` ("vllm"; refused where vLLM cannot run, naming `key`). Call `close` after, to free the engine."""
    if engine == "vllm":
        tokenizer = load_tokenizer(path, model.trust_remote_code)
        stop_ids = folder_stop_ids(path, tokenizer, model.trust_remote_code)
        llm = VllmEngine(path, vllm, model.dtype, seed, str(pick_device(model.device)), model.trust_remote_code,
                         key=key)
        return PlainSampler(tokenizer, stop_ids, lambda x_ids, seeds: llm.generate(
            x_ids, seeds, policy, stop_ids, policy.max_new_tokens), llm.close)
    hf_model, tokenizer = load_model(path, model)
    stop_ids = stop_token_ids(hf_model, tokenizer)

    @torch.no_grad()
    def generate(x_ids, seeds):
        return generate_batch(hf_model, x_ids, policy, seeds, stop_ids, tokenizer.pad_token_id)

    return PlainSampler(tokenizer, stop_ids, generate, lambda: None)


@dataclass
class PlainDecoder:
    """`greedy` (temperature 0) or `sample`: the model answers x directly. `longhand` asks it, in the same turn, to
    work the long way (the careful procedure its reflections use): the visible long-hand CoT baseline."""

    name: str
    policy: SamplingPolicy
    seed: int
    longhand: bool = False

    def __call__(self, model: Model, tokenizer: Tokenizer, examples: Sequence[Example], task: Task) -> list[Decoded]:
        def answer(prompts, seeds, stop_ids, pad_id):
            return generate_batch(model, prompts, self.policy, seeds, stop_ids, pad_id)

        messages = longhand_messages if self.longhand else attempt_messages
        return answer_directly(answer, model, tokenizer, examples, self.seed, self.name, messages)

    def on_engine(self, engine, model: Model, tokenizer: Tokenizer, examples: Sequence[Example]) -> list[Decoded]:
        """The same answers decoded by a `VllmEngine` (eval.engine=vllm): sampled rows draw with the same noise, so
        they equal this decoder's own up to float rounding. `model` gives the stop ids only."""
        def answer(prompts, seeds, stop_ids, pad_id):
            gens = engine.generate(prompts, seeds, self.policy, stop_ids, self.policy.max_new_tokens)
            for gen, prompt in zip(gens, prompts, strict=True):  # the prompt counts, as decode_prompts counts it
                gen.usage.prefill_tokens = len(prompt)
                gen.usage.fpe += len(prompt)
            return gens

        messages = longhand_messages if self.longhand else attempt_messages
        return answer_directly(answer, model, tokenizer, examples, self.seed, self.name, messages)
