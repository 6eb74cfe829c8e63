"""Every model the tests and the benchmarks build, in-process from a seed: no network, no downloaded weights, and
nothing read from `runs/`, so a result depends only on the code.

- The tests' tiny chat models (`build_tiny_tokenizer`, `build_tiny_model`): a character-level tokenizer whose turn
  markers and reflection markers are single special ids, and a 2-layer random Qwen2 or Llama.
- The train tests' tiny models (`build_train_tokenizer`, `build_train_model`): a smaller character set, the ids
  that tests/train_fixtures.py's harvest shards hold, and untied embeddings.
- The benchmarks' shapes: the embedded default's (`EmbeddedConfig` defaults: Llama, hidden 96, 4 layers, 4 heads,
  MLP 256, vocabulary 768, 0.52M parameters) with its byte-level BPE tokenizer trained the way `redumix embedded`
  trains it, and SmolLM2-135M's architecture. Random weights decode as fast as trained ones; only the shapes matter for
  speed.

It lives in bench/ and the tests import it: the tests already import bench/ (they check the benchmarks), while a
benchmark importing tests/ would depend on pytest's conftest. Neither folder is installed; both run from a checkout.
"""

from __future__ import annotations

import itertools
import string
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from redumix.data.arith import ArithConfig
from redumix.embedded.config import EmbeddedConfig
from redumix.embedded.corpus import corpus_episodes
from redumix.embedded.pretrain import build_model
from redumix.embedded.tokenizer import corpus_tokenizer

ARCHITECTURES = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}


def seeded_model(arch: str, seed: int, **config: Any) -> PreTrainedModel:
    """A random `arch` model ("qwen2" or "llama") of the given config: the same seed gives the same weights."""
    config_class, model_class = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    return model_class(config_class(**config))


def tiny_shape(hidden: int) -> dict[str, int]:
    """The tests' tiny body: 2 layers, 4 heads over 2 KV heads (so grouped-query attention is exercised)."""
    return dict(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=2 * hidden)


def char_tokenizer(vocab: list[str], split: str, template: str, **tokens: Any) -> PreTrainedTokenizerFast:
    """One id per entry of `vocab`, the text cut into single characters by the regex `split`, and the chat
    `template`. `tokens` names the special tokens as PreTrainedTokenizerFast takes them (`unk_token` is needed)."""
    ids = {token: i for i, token in enumerate(vocab)}
    core = Tokenizer(models.WordLevel(vocab=ids, unk_token=tokens["unk_token"]))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(split), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, **tokens)
    tokenizer.chat_template = template
    return tokenizer


# --- the tests' tiny chat models ------------------------------------------------------------------------------------

SPECIALS = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|reflect|>", "<|/reflect|>"]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TINY_SPLIT = r"[\s\S]"


def tiny_vocab(specials: list[str]) -> list[str]:
    """`specials`, then every printable character but three whitespace controls, then the unknown token."""
    return [*specials, *sorted(set(string.printable) - set("\x0b\x0c\r")), "<|unk|>"]


def build_tiny_tokenizer(specials: list[str] = SPECIALS) -> PreTrainedTokenizerFast:
    """A character-level tokenizer with a chat template whose turn markers are single special ids.

    `specials` starts with pad, end, user, assistant; what follows are extra single-id special tokens.
    """
    tokenizer = char_tokenizer(tiny_vocab(specials), TINY_SPLIT, TINY_CHAT_TEMPLATE, pad_token="<|pad|>",
                               eos_token="<|end|>", unk_token="<|unk|>", additional_special_tokens=specials[2:])
    tokenizer.padding_side = "left"
    return tokenizer


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast, arch: str = "qwen2", seed: int = 0, max_positions: int = 2048,
    hidden: int = 32,
) -> PreTrainedModel:
    model = seeded_model(
        arch, seed, **tiny_shape(hidden), vocab_size=len(tokenizer), max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    return model.eval()


# --- the train tests' tiny models -----------------------------------------------------------------------------------

TRAIN_SPECIALS = ["<pad>", "<eos>", "<unk>", "<|user|>", "<|assistant|>"]
TRAIN_CHARS = list(" \n0123456789+-*=.,?!:#abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
TRAIN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_train_tokenizer() -> PreTrainedTokenizerFast:
    # "." leaves a newline out of its matches, so a run of newlines is one piece (the unknown id): as it always was.
    return char_tokenizer(TRAIN_SPECIALS + TRAIN_CHARS, ".", TRAIN_CHAT_TEMPLATE, pad_token="<pad>", eos_token="<eos>",
                          unk_token="<unk>", additional_special_tokens=["<|user|>", "<|assistant|>"])


def build_train_model(vocab_size: int, arch: str = "llama", seed: int = 0, hidden: int = 32) -> PreTrainedModel:
    return seeded_model(
        arch, seed, **tiny_shape(hidden), vocab_size=vocab_size, max_position_embeddings=512,
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=1,
    )


# --- the benchmarks' shapes -----------------------------------------------------------------------------------------

SHAPE = EmbeddedConfig()


def embedded_tokenizer(seed: int = 0) -> PreTrainedTokenizerFast:
    base = EmbeddedConfig()
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
    model = seeded_model("llama", seed, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192, rope_theta=100000.0, pad_token_id=0, bos_token_id=None,
                         eos_token_id=1)
    return model.eval()
