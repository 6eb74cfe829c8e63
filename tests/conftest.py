"""Shared fixtures: tiny random chat models built in-process (no network, no downloaded weights)."""

from __future__ import annotations

import signal
import string
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIALS = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|reflect|>", "<|/reflect|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread inside, the caller's thread count restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def kill_when(process: subprocess.Popen, ready: Callable[[], bool], timeout: float = 300) -> None:
    """SIGKILL `process` as soon as `ready()` holds, and check that the kill interrupted it.

    A fault test kills at a point the run's own progress marks (a shard, a checkpoint, a record file), chosen so
    that real work is left after it. A kill after a random delay instead lands on a finished process on a fast host.
    """
    deadline = time.time() + timeout
    while not ready():
        if process.poll() is not None:
            pytest.fail(f"the process ended (exit {process.returncode}) before the point it was to be killed at")
        if time.time() > deadline:
            process.kill()
            pytest.fail(f"the kill point was not reached in {timeout} s")
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL, "the process finished before the kill: nothing was interrupted"


def build_tiny_tokenizer(specials: list[str] = SPECIALS) -> PreTrainedTokenizerFast:
    """A character-level tokenizer with a chat template whose turn markers are single special ids.

    `specials` starts with pad, end, user, assistant; what follows are extra single-id special tokens.
    """
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    vocab = {tok: i for i, tok in enumerate([*specials, *chars, "<|unk|>"])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<|pad|>",
        eos_token="<|end|>",
        unk_token="<|unk|>",
        additional_special_tokens=specials[2:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def build_tiny_model(tokenizer, arch: str = "qwen2", seed: int = 0, max_positions: int = 2048, hidden: int = 32):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    return model.eval()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_chat_model(tiny_tokenizer):
    """(model, tokenizer): a 2-layer random Qwen2 with a character-level chat tokenizer."""
    return build_tiny_model(tiny_tokenizer), tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_llama_chat_model(tiny_tokenizer):
    return build_tiny_model(tiny_tokenizer, arch="llama", seed=1), tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_chat_model):
    """The tiny chat model saved as a Hugging Face folder, for stages that load a model from disk."""
    model, tokenizer = tiny_chat_model
    path = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
