"""The one token-by-token decode loop, which every token-level decoder reuses.

A decoder supplies only its choice rule: given the next-token logits of the rows still decoding, which token each
emits (and, for Mixture of Inputs, which embedding to feed instead of the token's own). The loop does the rest:
it logs what was emitted, stops rows on a stop token, compacts finished rows out of the batch, and feeds the
choices back through the model. A batch may hold several contexts per example (ReDuMix decodes each example
from x and x2 at once): rows [c·n, (c+1)·n) hold context c of the n live examples, and every context is fed the
same token.

Rows that finish are compacted out of the batch, so a long answer never makes short ones pay for its steps.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from redumix.generate.accounting import Usage
from redumix.generate.state import DecodeState, forward, merge, prefill, select


@dataclass
class Generation:
    token_ids: list[int]  # every sampled id, including the stop token when the row stopped on one
    finished: bool  # stopped on a stop token (else it ran out of tokens)
    cached: int  # how many of token_ids are already in the returned state's cache
    usage: Usage = field(default_factory=Usage)

    def content_ids(self, stop_ids: Sequence[int]) -> list[int]:
        return self.token_ids[:-1] if self.finished and self.token_ids[-1] in stop_ids else self.token_ids


@dataclass
class Choice:
    """What the live examples emit at one step."""

    tokens: torch.Tensor  # [n] one token per live example
    logged: tuple[torch.Tensor, ...] = ()  # per-example values to keep for the output, [n] or [n, k] each
    inputs_embeds: torch.Tensor | None = None  # [n, D]: fed instead of the tokens' embeddings


# (next-token logits of the live rows [contexts·n, V], batch index of each live example [n], step) -> Choice
ChooseFn = Callable[[torch.Tensor, torch.Tensor, int], Choice]


@dataclass
class LoopResult:
    generations: list[Generation]  # one per example, in input order
    logged: list[tuple[list, ...]]  # per example, each logged column's values at the steps it emitted
    state: DecodeState | None = None  # with keep_state: every row's state, all tokens but the last cached


def should_compact(done: int, live: int) -> bool:
    """Compact once a quarter of the batch is done: each compaction copies the cache, so not every step."""
    return done > 0 and done * 4 >= live


@torch.inference_mode()
def decode_loop(
    model: PreTrainedModel,
    state: DecodeState,
    choose: ChooseFn,
    stop_ids: Sequence[int],
    max_new_tokens: int,
    contexts: int = 1,
    keep_state: bool = False,
) -> LoopResult:
    """Decode every example of `state` until a stop token or `max_new_tokens`.

    Each fed token costs one forward position per context, so a generation's FPE is `contexts` per cached token.
    With keep_state (one context only), also returns the state of every row, in input order, with all sampled
    tokens but the last in its cache, ready to be extended by a later turn; `Generation.cached` says how many.
    """
    if keep_state and contexts != 1:
        raise ValueError("keep_state needs one context per example")
    device = state.attention_mask.device
    stop = torch.as_tensor(list(stop_ids), device=device)
    n_examples = state.batch_size // contexts
    rows = list(range(n_examples))  # live row -> example index
    live = torch.arange(n_examples, device=device)
    alive = torch.ones(n_examples, dtype=torch.bool, device=device)
    retired: list[tuple[list[int], DecodeState]] = []  # with keep_state: finished examples and their rows' state
    emitted = StepLog()
    for step in range(max_new_tokens):
        choice = choose(state.last_logits, live, step)
        emitted.add(rows, alive, choice.tokens, *choice.logged)
        alive = alive & ~torch.isin(choice.tokens, stop)  # not in place: the log keeps this step's mask
        done = int((~alive).sum())
        if step == max_new_tokens - 1 or done == len(rows):
            break
        tokens, embeds = choice.tokens, choice.inputs_embeds
        if should_compact(done, len(rows)):
            if keep_state:
                gone = (~alive).nonzero().flatten()
                retired.append(([rows[i] for i in gone.tolist()], select(state, gone)))
            keep = alive.nonzero().flatten()
            state = select(state, torch.cat([keep + c * len(rows) for c in range(contexts)]))
            rows = [rows[i] for i in keep.tolist()]
            live, tokens = live[keep], tokens[keep]
            embeds = embeds[keep] if embeds is not None else None
            alive = torch.ones(len(rows), dtype=torch.bool, device=device)
        mask = alive.repeat(contexts).long()[:, None]
        if embeds is None:
            state = forward(model, state, mask, input_ids=tokens.repeat(contexts)[:, None])
        else:
            state = forward(model, state, mask, inputs_embeds=embeds.repeat(contexts, 1)[:, None])
    per_example = emitted.per_row(n_examples)
    generations = [generation_from(ids, stop_ids, fpe_per_token=contexts) for ids, *_ in per_example]
    logged = [tuple(columns) for _, *columns in per_example]
    return LoopResult(generations, logged, in_input_order([*retired, (rows, state)]) if keep_state else None)


def in_input_order(parts: list[tuple[list[int], DecodeState]]) -> DecodeState:
    """One state of every example in input order, from (examples, their rows' state) parts, with the all-padding
    columns on the left trimmed: the last part as it is when it holds every example in order (no row retired early,
    so no copy), else one merge and one select."""
    order = [example for examples, _ in parts for example in examples]
    if len(parts) == 1 and order == list(range(len(order))) and bool(parts[0][1].attention_mask[:, 0].any()):
        return parts[0][1]
    merged = merge([state for _, state in parts])
    return select(merged, sorted(range(len(order)), key=order.__getitem__))


def decode_prompts(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    choose: ChooseFn,
    stop_ids: Sequence[int],
    pad_id: int,
    max_new_tokens: int,
) -> list[Generation]:
    """Prefill a batch of prompts and decode them with `choose`; each generation's usage counts its prompt."""
    state = prefill(model, prompts, pad_id)
    gens = decode_loop(model, state, choose, stop_ids, max_new_tokens).generations
    for gen, prompt in zip(gens, prompts, strict=True):
        gen.usage.prefill_tokens = len(prompt)
        gen.usage.fpe += len(prompt)
    return gens


class StepLog:
    """What a decode loop emitted per step, kept as tensors and turned into Python lists once, at the end.

    Converting as it goes costs a `.tolist()` per tensor per step and a Python loop over the rows each time; the
    loop itself only needs one number per step (how many rows are done).
    """

    def __init__(self) -> None:
        self.rows: list[list[int]] = []
        self.alive: list[torch.Tensor] = []
        self.columns: list[list[torch.Tensor]] = []

    def add(self, rows: list[int], alive: torch.Tensor, *columns: torch.Tensor) -> None:
        """One step: the output index of each batch row, which rows were alive, and per-row values ([n] or [n, k])."""
        self.rows.append(rows)
        self.alive.append(alive)
        self.columns.append(list(columns))

    def per_row(self, n: int) -> list[tuple[list, ...]]:
        """For each of the `n` outputs, each column's values at the steps where that output was alive."""
        width = len(self.columns[0]) if self.columns else 0
        if not self.rows:
            return [tuple([] for _ in range(width)) for _ in range(n)]
        alive = torch.cat(self.alive)
        # Each kept value's output, then the values grouped by output: a stable sort keeps every output's steps in
        # order, so one slice per output and column replaces an append per value.
        outputs = torch.as_tensor([row for rows in self.rows for row in rows], device=alive.device)[alive]
        order = torch.argsort(outputs, stable=True)
        bounds = list(itertools.accumulate(as_lists(torch.bincount(outputs, minlength=n)), initial=0))
        columns = [as_lists(torch.cat(column)[alive][order]) for column in zip(*self.columns, strict=True)]
        return [tuple(values[start:end] for values in columns) for start, end in itertools.pairwise(bounds)]


NO_NUMPY = (torch.bfloat16,)  # the dtypes a tensor can hold that NumPy cannot


def as_lists(values: torch.Tensor) -> list:
    """`values.tolist()`, through NumPy where the dtype allows: the same Python values, and for the int64 top-k ids
    a harvest step logs, about 10x faster (torch's `tolist` takes ~0.7 µs an int64, NumPy's ~0.06)."""
    values = values.detach().cpu()
    return values.tolist() if values.dtype in NO_NUMPY else values.numpy().tolist()


def generation_from(token_ids: list[int], stop_ids: Sequence[int], fpe_per_token: int) -> Generation:
    """A finished loop's row. A row stops on its first stop token, so it finished iff its last token is one; every
    token but the last went through the model (the loop never feeds the token it ends on)."""
    finished = bool(token_ids) and token_ids[-1] in stop_ids
    cached = max(len(token_ids) - 1, 0)
    usage = Usage(fpe=fpe_per_token * cached, generated_tokens=len(token_ids), visible_tokens=len(token_ids))
    return Generation(token_ids, finished, cached, usage)
