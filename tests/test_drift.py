"""pipeline/studies/drift.py: the loss of general text against transformers' own, KL(tuned ‖ base) at zero for a model
against itself, and the general set read with errors that name the file and line."""

from __future__ import annotations

import json

import pytest
import torch

from redumix.pipeline.studies import drift
from redumix.pipeline.studies.drift import chunks_within, kl_per_token, read_general_set, text_nll

TEXTS = ["Natalia sold 48 clips in April.", "She sold half as many in May: 48/2 = 24.", "#### 72"]


def test_text_nll_is_transformers_loss_pooled_over_tokens(tiny_chat_model) -> None:
    model, tokenizer = tiny_chat_model
    total, tokens = 0.0, 0
    with torch.no_grad():
        for text in TEXTS:
            ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
            loss = model(input_ids=ids, labels=ids).loss  # mean over the len - 1 predicted tokens
            total += float(loss) * (ids.shape[1] - 1)
            tokens += ids.shape[1] - 1
    # Batched (right-padded) against one unpadded text at a time.
    assert text_nll(model, tokenizer, TEXTS, batch=2) == pytest.approx(total / tokens, rel=1e-5)


def test_kl_is_zero_against_itself_and_positive_against_another(tiny_chat_model, tiny_llama_chat_model) -> None:
    model, tokenizer = tiny_chat_model
    other, _ = tiny_llama_chat_model
    xs = [tokenizer("12 + 3 =", add_special_tokens=False)["input_ids"], [5, 6]]
    ys = [[7, 8, 9], [10], []]  # a row with no tokens is skipped
    xs.append([4])
    assert kl_per_token(model, model, xs, ys, tokenizer.pad_token_id) == pytest.approx(0.0, abs=1e-6)
    assert kl_per_token(model, other, xs, ys, tokenizer.pad_token_id, batch=1) > 0.01


def test_chunks_keep_each_forward_within_the_logit_budget() -> None:
    lengths = [3, 9, 2, 2, 5, 1]
    # 4-byte logits over a vocabulary of 10: a budget of 400 bytes is 10 padded positions a forward.
    chunks = chunks_within(lengths, rows=3, vocab=10, max_bytes=400)
    assert [i for c in chunks for i in c] == list(range(6))  # every row once, in order
    assert chunks == [[0], [1], [2, 3], [4, 5]]  # [2, 3, 4] would be 3 x 5 = 15 positions
    assert all(len(c) * max(lengths[i] for i in c) <= 10 or len(c) == 1 for c in chunks)
    assert chunks_within(lengths, rows=2, vocab=1, max_bytes=1 << 20) == [[0, 1], [2, 3], [4, 5]]


def test_measures_do_not_depend_on_the_budget(tiny_chat_model, tiny_llama_chat_model, monkeypatch) -> None:
    """A budget of one row a forward gives the same KL and loss as one forward for all (right padding is exact)."""
    model, tokenizer = tiny_chat_model
    other, _ = tiny_llama_chat_model
    xs = [tokenizer("12 + 3 =", add_special_tokens=False)["input_ids"], [5, 6], [4]]
    ys = [[7, 8, 9], [10], [11, 12]]
    whole = kl_per_token(model, other, xs, ys, tokenizer.pad_token_id), text_nll(model, tokenizer, TEXTS)
    monkeypatch.setattr(drift, "LOGIT_BYTES_PER_FORWARD", 1)
    single = kl_per_token(model, other, xs, ys, tokenizer.pad_token_id), text_nll(model, tokenizer, TEXTS)
    assert single == pytest.approx(whole, rel=1e-5)


def test_read_general_set(tmp_path) -> None:
    path = tmp_path / "g.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": f"a{i}"}) for i in range(5)) + "\n")
    general = read_general_set(path, 3)
    assert general.questions == ["q0", "q1", "q2"] and general.texts == ["a0", "a1", "a2"]
    path.write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(ValueError, match=r"g.jsonl:1: expected an object with non-empty 'question' and 'answer'"):
        read_general_set(path, 3)
    with pytest.raises(FileNotFoundError, match="evidence.general_path"):
        read_general_set(tmp_path / "missing.jsonl", 3)
