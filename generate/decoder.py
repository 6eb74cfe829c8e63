"""The decoder interface: every decoder is called the same way and returns the same result type.

A decoder is a dataclass holding its own settings, with a `name`, a `needs_hf_engine` flag and a
`__call__(engine, examples, task)` that returns one `Decoded` per example. It decodes through the engine
protocol (engine.py), so it runs on redumix's loop or on vLLM alike; one that needs the cache token by token
sets `needs_hf_engine = True` and is always handed an `HfEngine` (its model through `hf_parts`). Eval maps a
decoder name to a decoder and calls it; nothing else about a decoder is known outside its own module.
`fingerprint(decoder)` is derived from the decoder's settings, so a change to any of them invalidates the records
it made.

The name is also the salt of each example's sampling noise (`example_seed(seed, f"{id}/{name}")`), so two
decoders never share their random draws.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from redumix.data.chat import decode_text, prompt_ids
from redumix.data.prompts import attempt_messages
from redumix.data.task import Example, Task
from redumix.generate.accounting import Usage
from redumix.generate.engine import Engine
from redumix.generate.loop import Generation
from redumix.generate.policy import example_seed


@dataclass
class Decoded:
    text: str  # the answer the user sees, without the stop token
    token_ids: list[int]  # its ids as emitted (the stop token included when it ended on one)
    usage: Usage
    extra: dict[str, Any] = field(default_factory=dict)  # per-decoder details, kept in eval's records


# (prompts, per-example seeds) -> one generation per prompt: a decoder that answers x directly
GenerateFn = Callable[[list[list[int]], list[int]], list[Generation]]


class Decoder(Protocol):
    name: str
    needs_hf_engine: bool  # True: it needs the cache token by token, so it is handed an HfEngine

    def __call__(self, engine: Engine, examples: Sequence[Example], task: Task) -> list[Decoded]: ...


def fingerprint(decoder: Decoder) -> str:
    """A hash of the decoder's kind and every setting it holds (decoders are dataclasses)."""
    if not dataclasses.is_dataclass(decoder):
        raise TypeError(f"decoder {decoder!r} must be a dataclass, so that its settings decide its fingerprint")
    settings = {"kind": type(decoder).__name__, **dataclasses.asdict(decoder)}
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:12]


MessagesFn = Callable[[str], list[dict[str, str]]]  # a task's prompt -> the chat turns the model answers


def attempt_prompts(
    tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], messages: MessagesFn = attempt_messages
) -> list[list[int]]:
    """Each example's prompt x (or another rendering of it) as the chat template renders it, ready for the
    assistant's turn."""
    return [prompt_ids(tokenizer, messages(e.prompt)) for e in examples]


def example_seeds(seed: int, examples: Sequence[Example], name: str) -> list[int]:
    return [example_seed(seed, f"{e.id}/{name}") for e in examples]


def answer_directly(
    generate: GenerateFn,
    engine: Engine,
    examples: Sequence[Example],
    seed: int,
    name: str,
    messages: MessagesFn = attempt_messages,
) -> list[Decoded]:
    """Run a decoder that answers each prompt x in one generation, and wrap its generations as results."""
    tokenizer, stop_ids = engine.tokenizer, engine.stop_ids
    gens = generate(attempt_prompts(tokenizer, examples, messages), example_seeds(seed, examples, name))
    return [Decoded(decode_text(tokenizer, g.content_ids(stop_ids)), g.token_ids, g.usage)
            for g in gens]
