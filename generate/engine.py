"""The engine seam: the few operations every decoder and stage needs from whatever runs the model.

An engine holds a batch of contexts, one per example, and knows how to grow them and decode from them:

- `sample(prompts, seeds, policy)`: plain samples of token-id prompts (eval's greedy and sampled decoders, the
  ladder's resamples, RFT's samples, the off-task answers of the drift measure);
- `open`, `extend`, `continue_turn`, `fork`, `reopen`: a conversation kept per row, grown turn by turn (ReDuMix's
  attempt, critique, reflection and x2, written once over this protocol in `redumix.py`);
- `mix_redo(x, x2, ...)`: the paired mixture redo, each token drawn from p_mix of the two contexts, with its top-k
  and tail.

Two engines fill it. `HfEngine` (hf_engine.py) keeps a growing KV cache per row, so a context is a `DecodeState`
that each turn extends in place. `VllmEngine` (vllm_engine.py) re-sends the whole prefix with each request, so a
context is the token ids themselves; vLLM's prefix cache finds the earlier turns' blocks. Both draw a row's noise from
its seed and its output index, so a row is the same whatever else is in its batch and whichever engine decoded it,
up to float rounding.

A context's tokens after `continue_turn(..., keep=True)` are the old ones plus every generated token but the last,
`Generation.cached` of them: the loop never feeds the token it ends on. The caller feeds what is missing of the turn
with the next segment, so the two engines count prefill and FPE alike (the counting lives with the caller).

A decoder that needs the cache token by token (Reflective, Mixture of Inputs, CNTP, Speculative Thinking, PDR) says
so with `needs_hf_engine = True` on its class and takes the model through `hf_parts(engine)`; pipeline/engines.py
gives it an `HfEngine` whatever engine the recipe names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from redumix.generate.loop import Generation
from redumix.generate.policy import SamplingPolicy

# What an engine keeps per batch of rows: a DecodeState (HfEngine) or the rows' token ids (VllmEngine). Callers
# never look inside; they pass it back to the engine that made it.
Contexts = Any


@dataclass
class MixedRedo:
    """One example's redo under p_mix: the generation and, per token, the top-k of p_mix and the log of its tail."""

    generation: Generation
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]
    tail_logprobs: list[float]
    retries: int = 0  # times vLLM split this pair and decoded it again (always 0 on HfEngine)


class Engine(Protocol):
    name: str  # "hf" or "vllm": recorded with what it decodes, since the two differ at bf16 near ties
    tokenizer: PreTrainedTokenizerBase
    stop_ids: list[int]  # every id that ends an assistant turn
    window: int | None  # positions the model attends over (max_position_embeddings), or None for no limit

    def sample(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int],
               policy: SamplingPolicy) -> list[Generation]:
        """Plain decoding of each prompt, up to `policy.max_new_tokens`; each generation's usage counts its prompt."""
        ...

    def open(self, prompts: Sequence[Sequence[int]]) -> Contexts:
        """Contexts holding the prompts, ready to decode from."""
        ...

    def extend(self, contexts: Contexts, segments: Sequence[Sequence[int]]) -> Contexts:
        """Each row's context followed by its segment (the rest of a turn, the template up to the next one)."""
        ...

    def continue_turn(self, contexts: Contexts, seeds: Sequence[int], policy: SamplingPolicy, max_tokens: int,
                      keep: bool) -> tuple[list[Generation], Contexts | None]:
        """The next turn of every row. With `keep`, the contexts grown by each turn's `cached` tokens; else None
        (the contexts may be used up)."""
        ...

    def fork(self, contexts: Contexts, rows: Sequence[int] | None = None) -> Contexts:
        """A copy that decoding from leaves `contexts` as they are: of every row, or of `rows` in that order (a row
        may come several times: the redos of one shared attempt)."""
        ...

    def reopen(self, contexts: Contexts, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> Contexts:
        """`contexts` with the listed rows replaced by new prompts (the redo's window cut re-encodes a row)."""
        ...

    def lengths(self, contexts: Contexts) -> list[int]:
        """Positions each row's context holds."""
        ...

    def mix_redo(self, x: Contexts, x2: Contexts, seeds: Sequence[int], lam: float, topk: int,
                 policy: SamplingPolicy) -> list[MixedRedo]:
        """Each row decoded from p_mix = softmax(λ·log p(·|x) + (1−λ)·log p(·|x2)), up to `policy.max_new_tokens`.
        The contexts may be used up: `fork` them to decode again."""
        ...

    def close(self) -> None:
        """Let the engine's weights and cache go before the next stage of this process."""
        ...
