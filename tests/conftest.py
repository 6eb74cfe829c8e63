"""Shared fixtures: tiny random chat models (built by bench/models.py, in-process, no network) and helpers that
bound a test's threads and kill a run at a point of its own progress."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from bench.models import build_tiny_model, build_tiny_tokenizer


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


# What "the same rows after a resume" promises (docs/robustness.md): every id, text and verdict exactly; the stored
# floats to their own precision, since two processes may compute the same float32 sum in another order. The top-k
# log-probs are float16 (a step of 2**-10 relative); the tail is float32 from a logsumexp over the vocabulary.
FLOAT_COLUMNS = {"mix_topk_logprobs": (2**-9, 1e-4), "mix_tail_logprob": (1e-5, 1e-5)}  # column: (rtol, atol)


def rows_differ(a: list[dict], b: list[dict]) -> list[str]:
    """Where two harvests' rows differ beyond FLOAT_COLUMNS' tolerances: [] when they are the same rows."""
    if len(a) != len(b):
        return [f"{len(a)} rows against {len(b)}"]
    problems = []
    for x, y in zip(a, b, strict=True):
        for key in sorted(x.keys() | y.keys()):
            if key not in FLOAT_COLUMNS:
                if x.get(key) != y.get(key):
                    problems.append(f"{x.get('id')}: {key} differs")
                continue
            left, right = torch.tensor(x[key], dtype=torch.float64), torch.tensor(y[key], dtype=torch.float64)
            rtol, atol = FLOAT_COLUMNS[key]
            if left.shape != right.shape or not torch.allclose(left, right, rtol=rtol, atol=atol):
                gap = (left - right).abs().max().item() if left.shape == right.shape else "shape"
                problems.append(f"{x.get('id')}: {key} differs beyond its tolerance (max |Δ| {gap})")
    return problems


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
