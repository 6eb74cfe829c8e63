"""A train step with the sparse GKD loss against the same step with plain cross-entropy (`make bench`).

Same model, same batch, same optimizer: forward in float32 (as the tiny recipe trains on CPU), the loss,
backward, AdamW step. Only the loss differs: the sparse generalized JSD over the stored top-k + tail
(train/loss.py) against cross-entropy on the redo tokens. The two alternate, REPEATS times each after a warm-up,
and the medians are compared. `gkd_vs_sft_step` uses the embedded default's shape (bench/models.py: Llama,
hidden 96, 4 layers, vocabulary 768); `gkd_vs_sft_step_vocab32k` the same body with a 32k vocabulary, where the
loss is a larger share. Floor 1.0 on a CPU and a GPU alike: both losses need the student's full log-softmax, and the
sparse one only gathers k + 1 entries of it where cross-entropy gathers one.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from bench.models import embedded_model, embedded_tokenizer
from redumix.train.loss import select_targets, sparse_gkd_loss

REPEATS = 5
TOP_K = 32
BF16 = False  # as the tiny recipe trains: a CPU without native bf16 emulates autocast
TOKENIZER = embedded_tokenizer()


def _batch(vocab_size: int, rows: int, prompt: int, redo: int) -> dict[str, torch.Tensor]:
    """A harvest-like batch: prompt then redo, labels on the redo, a top-k teacher at every redo token."""
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab_size, (rows, prompt + redo), generator=gen)
    labels = input_ids.clone()
    labels[:, :prompt] = -100
    teacher = torch.log_softmax(torch.randn(rows * redo, vocab_size, generator=gen) * 3, dim=-1)
    values, ids = teacher.topk(TOP_K, dim=-1)
    return {"input_ids": input_ids, "labels": labels, "teacher_ids": ids, "teacher_logprobs": values.half().float()}


def _step(
    model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor], gkd: bool
) -> float:
    began = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=BF16):
        logits = model(input_ids=batch["input_ids"]).logits
    student, targets = select_targets(logits, batch["labels"])
    if gkd:
        loss = sparse_gkd_loss(student, batch["teacher_ids"], batch["teacher_logprobs"])
    else:
        loss = F.cross_entropy(student.float(), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - began


def step_ratio(vocab_size: int, rows: int = 16, prompt: int = 40, redo: int = 120) -> tuple[float, float, float]:
    """(median GKD step s, median CE step s, ratio)."""
    model = embedded_model(TOKENIZER, vocab_size=vocab_size).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = _batch(vocab_size, rows, prompt, redo)
    for gkd in (True, False):  # warm-up: allocator, autocast caches, AdamW state
        _step(model, optimizer, batch, gkd)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(REPEATS):
        for gkd in (True, False):
            times[gkd].append(_step(model, optimizer, batch, gkd))
    gkd_s, ce_s = statistics.median(times[True]), statistics.median(times[False])
    return gkd_s, ce_s, gkd_s / ce_s


def run() -> dict[str, float]:
    results = {}
    for key, vocab, rows in (("gkd_vs_sft_step", len(TOKENIZER), 16), ("gkd_vs_sft_step_vocab32k", 32768, 2)):
        gkd_s, ce_s, ratio = step_ratio(vocab, rows=rows)
        print(f"bench_train: vocab {vocab}, {rows}x160 tokens: GKD step {gkd_s * 1e3:.1f} ms, "
              f"CE step {ce_s * 1e3:.1f} ms, ratio {ratio:.3f}", flush=True)
        results[key] = round(ratio, 4)
    return results


if __name__ == "__main__":
    print(run())
