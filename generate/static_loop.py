"""The decode loop over a static cache (static_cache.py): one shape from the first step to the last, each row's stop
flag kept on the device, and one host sync every `check_every` steps to ask whether any row is left.

It takes the dynamic loop's choice rules (`plain_choice`, `mixture_choice`), so the mixture, its top-k and tail and
the draw are the same code as in loop.py. A step feeds the last tokens (a finished row's masked), moves the step
counter, chooses, writes the choice into fixed buffers at the step's index and clears the flags of rows that emitted
a stop token: all on the device, with no Python number in between. So on CUDA, with `graphs=True`, the step is
captured once as a `torch.cuda.CUDAGraph` (after a few eager steps on a side stream) and replayed; on a CPU it runs
eagerly, and there, in float32, its ids equal the dynamic loop's and its stored log-probs agree within 1e-5
(tests/test_static_cache.py). Rows are never compacted: a finished row rides along, masked, until the batch ends.

`static_sample_loop` and `static_mixture_loop` take and return what `sample_loop` and `mixture_loop` do, so an
engine can decode a turn or the paired redo on either path.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import cast

import torch
from transformers import PreTrainedModel

from redumix.generate.loop import Choice, ChooseFn, Generation, LoopResult, as_lists, generation_from
from redumix.generate.mixture import mixture_choice, mixture_contexts
from redumix.generate.plain import plain_choice
from redumix.generate.policy import SamplingPolicy
from redumix.generate.state import DecodeState
from redumix.generate.static_cache import StaticContexts, decode_state, static_contexts, static_forward

CHECK_EVERY = 8  # steps between the host's looks at whether any row is still decoding
WARMUP_STEPS = 2  # eager steps on a side stream before a CUDA graph is captured (cuBLAS sets itself up on them)


class StepBuffers:
    """What the loop emitted, in fixed buffers [n, steps, ...] written at the step's index (a device tensor), and
    turned into Python lists once, at the end."""

    def __init__(self, first: Choice, steps: int) -> None:
        n = first.tokens.shape[0]
        self.tokens = first.tokens.new_zeros((n, steps))
        self.alive = torch.zeros((n, steps), dtype=torch.bool, device=first.tokens.device)
        self.columns = [c.new_zeros((n, steps, *c.shape[1:])) for c in first.logged]

    def write(self, step: torch.Tensor, choice: Choice, alive: torch.Tensor) -> None:
        self.tokens.index_copy_(1, step, choice.tokens[:, None])
        self.alive.index_copy_(1, step, alive[:, None])
        for buffer, values in zip(self.columns, choice.logged, strict=True):
            buffer.index_copy_(1, step, values.unsqueeze(1))

    def per_row(self, steps: int) -> list[tuple[list, ...]]:
        """Per row: its tokens, then each logged column's values, at the steps where the row was alive."""
        alive = self.alive[:, :steps]
        # A mask picks in row-major order: every row's values, in step order, one row after another.
        bounds = list(itertools.accumulate(as_lists(alive.sum(dim=1)), initial=0))
        found = [as_lists(t[:, :steps][alive]) for t in (self.tokens, *self.columns)]
        return [tuple(column[start:end] for column in found) for start, end in itertools.pairwise(bounds)]


@torch.inference_mode()
def static_loop(
    model: PreTrainedModel,
    contexts: StaticContexts,
    choose: ChooseFn,
    stop_ids: Sequence[int],
    max_new_tokens: int,
    contexts_per_example: int = 1,
    keep_state: bool = False,
    check_every: int = CHECK_EVERY,
    graphs: bool = False,
) -> LoopResult:
    """Decode every example of `contexts` until a stop token or `max_new_tokens`, as `decode_loop` does (the same
    `LoopResult`; with keep_state, the state as the dynamic path's `DecodeState`). The cache needs
    `max_new_tokens − 1` free columns: the token a row ends on is never fed."""
    device = contexts.mask.device
    if keep_state and contexts_per_example != 1:
        raise ValueError("keep_state needs one context per example")
    if graphs and device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
    if contexts.capacity - int(contexts.column) < max_new_tokens - 1:
        raise ValueError(f"{max_new_tokens} new tokens need {max_new_tokens - 1} free columns; the static cache "
                         f"has {contexts.capacity - int(contexts.column)}")
    n, k = contexts.batch_size // contexts_per_example, contexts_per_example
    stop = torch.as_tensor(list(stop_ids), dtype=torch.long, device=device)
    live = torch.arange(n, device=device)
    step = torch.zeros(1, dtype=torch.long, device=device)
    # The choice rules take the step as a device tensor as well as an int (their draw, `sample_tokens`, does): here
    # it must be a tensor, which the graph advances in place.
    at_step = cast(int, step)
    alive = torch.ones(n, dtype=torch.bool, device=device)
    first = choose(contexts.last_logits, live, at_step)
    tokens = first.tokens.clone()
    log = StepBuffers(first, max_new_tokens)
    log.write(step, first, alive)
    alive &= ~(tokens[:, None] == stop).any(dim=1)

    def one_step() -> None:
        static_forward(model, contexts, tokens.repeat(k)[:, None], alive.repeat(k)[:, None])
        step.add_(1)
        choice = choose(contexts.last_logits, live, at_step)
        tokens.copy_(choice.tokens)
        log.write(step, choice, alive)
        alive.logical_and_(~(tokens[:, None] == stop).any(dim=1))

    done, run = 1, one_step
    if graphs and max_new_tokens - done > WARMUP_STEPS:
        run = captured(one_step, WARMUP_STEPS)
        done += WARMUP_STEPS
    while done < max_new_tokens and bool(alive.any()):
        for _ in range(min(check_every, max_new_tokens - done)):
            run()
            done += 1
    per_example = log.per_row(done)
    generations = [generation_from(ids, stop_ids, fpe_per_token=k) for ids, *_ in per_example]
    logged = [tuple(columns) for _, *columns in per_example]
    return LoopResult(generations, logged, decode_state(contexts) if keep_state else None)


def captured(step: Callable[[], None], warmup: int) -> Callable[[], None]:
    """`step` run `warmup` times on a side stream (real steps: they decode), then captured as a CUDA graph; returns
    the graph's replay, which repeats the step on the same buffers."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def static_sample_loop(
    model: PreTrainedModel,
    state: DecodeState,
    policy: SamplingPolicy,
    seeds: torch.Tensor,
    stop_ids: Sequence[int],
    max_new_tokens: int | None = None,
    banned_ids: Sequence[int] = (),
    keep_state: bool = False,
    graphs: bool = False,
) -> LoopResult:
    """`sample_loop` on the static path: plain decoding of every row of `state`."""
    if graphs and banned_ids:
        raise ValueError("banned ids are not captured in a CUDA graph; decode them eagerly")
    tokens = max_new_tokens or policy.max_new_tokens
    contexts = static_contexts([state], room=tokens - 1)
    choose = plain_choice(policy, seeds.to(contexts.mask.device), banned_ids)
    return static_loop(model, contexts, choose, stop_ids, tokens, keep_state=keep_state, graphs=graphs)


def static_mixture_loop(
    model: PreTrainedModel,
    x_context: DecodeState,
    x2_context: DecodeState,
    lam: float,
    topk: int,
    policy: SamplingPolicy,
    seeds: torch.Tensor,
    stop_ids: Sequence[int],
    max_new_tokens: int | None = None,
    graphs: bool = False,
) -> list[tuple[Generation, list[list[int]], list[list[float]], list[float]]]:
    """`mixture_loop` on the static path: x's and x2's rows in one static cache, one forward of 2B rows a token."""
    tokens = max_new_tokens or policy.max_new_tokens
    read = mixture_contexts(lam, x_context, x2_context)
    contexts = static_contexts(read, room=tokens - 1)
    choose = mixture_choice(lam, topk, policy, seeds.to(contexts.mask.device))
    result = static_loop(model, contexts, choose, stop_ids, tokens, contexts_per_example=len(read), graphs=graphs)
    return [(gen, *logged) for gen, logged in zip(result.generations, result.logged, strict=True)]
