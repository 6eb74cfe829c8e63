"""`HfEngine`: the engine protocol (engine.py) on a transformers model, with redumix's own decode loop.

A row's context is its KV cache, which grows in place turn by turn (`DecodeState`, state.py): a later turn feeds only
its new tokens. x and x2 of a redo are two such caches decoded in one batched forward per token (mixture.py).

With `static_cache`, every turn and redo decodes on the static path (static_loop.py: one shape from the first step
to the last, stop flags on the device, and on CUDA a captured graph replayed each step), the same ids as the dynamic
loop in float32; the contexts between turns stay `DecodeState`s, so the stages above never know which runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from redumix.generate.engine import Engine, MixedRedo
from redumix.generate.loop import Generation
from redumix.generate.mixture import mixture_loop
from redumix.generate.model_io import stop_token_ids
from redumix.generate.plain import generate_batch, sample_loop
from redumix.generate.policy import SamplingPolicy
from redumix.generate.state import DecodeState, clone, extend, merge, prefill, select
from redumix.generate.static_loop import static_mixture_loop, static_sample_loop


class HfEngine:
    name = "hf"

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, static_cache: bool = False) -> None:
        self.model = model
        self.static_cache = static_cache
        self.graphs = static_cache and model.device.type == "cuda"  # a CPU runs the static path eagerly
        self.tokenizer = tokenizer
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.window: int | None = getattr(model.config, "max_position_embeddings", None)
        self.pad_id: int = tokenizer.pad_token_id

    @torch.no_grad()
    def sample(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int],
               policy: SamplingPolicy) -> list[Generation]:
        if not self.static_cache:
            return generate_batch(self.model, prompts, policy, seeds, self.stop_ids, self.pad_id)
        gens, _ = self.continue_turn(self.open(prompts), seeds, policy, policy.max_new_tokens, keep=False)
        for gen, prompt in zip(gens, prompts, strict=True):  # the prompt counts, as generate_batch counts it
            gen.usage.prefill_tokens = len(prompt)
            gen.usage.fpe += len(prompt)
        return gens

    @torch.no_grad()
    def open(self, prompts: Sequence[Sequence[int]]) -> DecodeState:
        return prefill(self.model, prompts, self.pad_id)

    @torch.no_grad()
    def extend(self, contexts: DecodeState, segments: Sequence[Sequence[int]]) -> DecodeState:
        return extend(self.model, contexts, segments, self.pad_id)

    @torch.no_grad()
    def continue_turn(self, contexts: DecodeState, seeds: Sequence[int], policy: SamplingPolicy, max_tokens: int,
                      keep: bool) -> tuple[list[Generation], DecodeState | None]:
        seeds_t = torch.as_tensor(list(seeds), dtype=torch.long)
        if self.static_cache:
            result = static_sample_loop(self.model, contexts, policy, seeds_t, self.stop_ids, max_tokens,
                                        keep_state=keep, graphs=self.graphs)
        else:
            result = sample_loop(self.model, contexts, policy, seeds_t, self.stop_ids, max_tokens, keep_state=keep)
        return result.generations, result.state

    def fork(self, contexts: DecodeState, rows: Sequence[int] | None = None) -> DecodeState:
        return clone(contexts) if rows is None else select(contexts, list(rows))

    @torch.no_grad()
    def reopen(self, contexts: DecodeState, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> DecodeState:
        if not rows:
            return contexts
        kept = [i for i in range(contexts.batch_size) if i not in set(rows)]
        parts = ([select(contexts, kept)] if kept else []) + [prefill(self.model, prompts, self.pad_id)]
        order = kept + list(rows)
        return select(merge(parts), [order.index(i) for i in range(len(order))])

    def lengths(self, contexts: DecodeState) -> list[int]:
        return contexts.lengths.tolist()

    @torch.no_grad()
    def mix_redo(self, x: DecodeState, x2: DecodeState, seeds: Sequence[int], lam: float, topk: int,
                 policy: SamplingPolicy) -> list[MixedRedo]:
        seeds_t = torch.as_tensor(list(seeds), dtype=torch.long)
        if self.static_cache:
            found = static_mixture_loop(self.model, x, x2, lam, topk, policy, seeds_t, self.stop_ids,
                                        graphs=self.graphs)
        else:
            found = mixture_loop(self.model, x, x2, lam, topk, policy, seeds_t, self.stop_ids)
        return [MixedRedo(gen, ids, logprobs, tail) for gen, ids, logprobs, tail in found]

    def close(self) -> None:
        pass  # the model belongs to whoever loaded it


def hf_parts(engine: Engine) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer of an `HfEngine`, for a decoder that needs the cache token by token
    (`needs_hf_engine = True`); pipeline/engines.py hands such a decoder an HfEngine whatever the recipe's engine."""
    if not isinstance(engine, HfEngine):
        raise TypeError(f"this decoder needs the cache token by token, which the {engine.name!r} engine does not "
                        "give; decode it on an HfEngine")
    return engine.model, engine.tokenizer
