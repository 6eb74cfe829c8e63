"""The models the benchmarks measure, built in-process from a seed, so a result never depends on what lies in
`runs/`: the embedded default's shape (`BaseConfig` defaults: Llama, hidden 96, 4 layers, 4 heads, MLP 256,
vocabulary 768, 0.52M parameters) with random weights, and its byte-level BPE tokenizer trained the way
`redumix base` trains it. Random weights decode as fast as trained ones; only the shapes matter for speed.
"""

from __future__ import annotations

import itertools

from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from redumix.data.arith import ArithTask
from redumix.data.chat import CHAT_TEMPLATE
from redumix.data.task import TaskConfig
from redumix.pipeline.base import build_model, episode_texts, train_tokenizer
from redumix.pipeline.config import BaseConfig

SHAPE = BaseConfig()


def embedded_tokenizer(seed: int = 0) -> PreTrainedTokenizerFast:
    base = BaseConfig()
    episodes = itertools.islice(ArithTask(TaskConfig(), seed).training_episodes(base.corpus_spec()), 3000)
    return train_tokenizer(episode_texts(list(episodes)) + [CHAT_TEMPLATE], base.vocab_size)


def embedded_model(
    tokenizer: PreTrainedTokenizerFast, seed: int = 0, vocab_size: int | None = None
) -> LlamaForCausalLM:
    """The embedded default's shape with seeded random weights (`vocab_size` swaps the vocabulary only)."""
    return build_model(SHAPE, tokenizer, seed, vocab_size).eval()


def describe(model: LlamaForCausalLM) -> str:
    c = model.config
    params = sum(p.numel() for p in model.parameters())
    return (f"random Llama of the embedded shape: hidden {c.hidden_size}, {c.num_hidden_layers} layers, "
            f"vocab {c.vocab_size}, {params / 1e6:.2f}M parameters, seed-built")
