"""The models the benchmarks measure, built in-process from a seed, so a result never depends on what lies in
`runs/`: the embedded default's shape (`BaseConfig` defaults: Llama, hidden 96, 4 layers, 4 heads, MLP 256,
vocabulary 768, 0.52M parameters) with random weights, and its byte-level BPE tokenizer trained the way
`redumix base` trains it. Random weights decode as fast as trained ones; only the shapes matter for speed.
"""

from __future__ import annotations

import itertools

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from redumix.data.arith import ArithConfig
from redumix.embedded.config import BaseConfig
from redumix.embedded.corpus import corpus_episodes
from redumix.embedded.pretrain import build_model
from redumix.embedded.tokenizer import corpus_tokenizer

SHAPE = BaseConfig()


def embedded_tokenizer(seed: int = 0) -> PreTrainedTokenizerFast:
    base = BaseConfig()
    episodes = itertools.islice(corpus_episodes(ArithConfig(), base.corpus, seed), 3000)
    return corpus_tokenizer(list(episodes), base.vocab_size)


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


def smollm2_shape_model(seed: int = 0) -> LlamaForCausalLM:
    """SmolLM2-135M's architecture (hidden 576, 30 layers, 9 heads / 3 KV heads, MLP 1536, vocabulary 49,152, tied
    embeddings) with seeded random weights: a real model's cost, with no download. Prompts from the embedded
    tokenizer (ids < 768) are valid ids for it."""
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192, rope_theta=100000.0, pad_token_id=0, bos_token_id=None,
                         eos_token_id=1)
    return LlamaForCausalLM(config).eval()
