"""Run folders for the train tests: a tiny base model (bench/models.py's `build_train_model`) and harvest shards
whose p_mix is a fixed random bigram model (so a student can really learn it and its KL really falls)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.models import TRAIN_SPECIALS, build_train_model, build_train_tokenizer
from redumix.data.shards import encode_shard, shard_name, shard_paths, shard_record


def write_base(folder: Path, arch: str = "llama", seed: int = 0) -> Path:
    tokenizer = build_train_tokenizer()
    model = build_train_model(len(tokenizer), arch=arch, seed=seed)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def x2_context(low: int, high: int, row: int) -> list[int]:
    return torch.randint(low, high, (40,), generator=torch.Generator().manual_seed(row)).tolist()


def write_harvest(folder: Path, n_rows: int = 48, k: int = 8, length: int = 24, seed: int = 0,
                  shard_rows: int = 32, with_x2: bool = True) -> None:
    """Shards with the harvest's columns (docs/design.md). Every row's redo follows one bigram teacher; logprobs
    stored as float16."""
    tokenizer = build_train_tokenizer()
    vocab = len(tokenizer)
    gen = torch.Generator().manual_seed(seed)
    first_char = len(TRAIN_SPECIALS)
    bigram = torch.randn(vocab, vocab, generator=gen) * 3.0
    bigram[:, :first_char] = -30.0  # the teacher never emits special tokens
    log_p = torch.log_softmax(bigram, dim=-1)
    rows = []
    for i in range(n_rows):
        token = int(torch.randint(first_char, vocab, (1,), generator=gen))
        ids, topk_ids, topk_lps, tails = [], [], [], []
        for _ in range(length):
            top = torch.topk(log_p[token], k)
            nxt = int(torch.multinomial(log_p[token].exp(), 1, generator=gen))
            ids.append(nxt)
            topk_ids.append(top.indices.tolist())
            topk_lps.append(top.values.half().tolist())
            tails.append(float(torch.logsumexp(log_p[token].double().scatter(0, top.indices, float("-inf")), 0)))
            token = nxt
        original_correct = i % 3 == 0
        redo_correct = i % 2 == 0
        rows.append({
            "id": f"t-{i:05d}", "task": "arith", "prompt": f"What is {i} + {i % 7}?", "reference": str(i + i % 7),
            "original": "12", "original_correct": original_correct, "feedback": "The answer is wrong.",
            "reflection": "Recheck.", "redo": tokenizer.decode(ids), "redo_correct": redo_correct,
            "redo_token_ids": ids, "mix_topk_ids": topk_ids, "mix_topk_logprobs": topk_lps, "lam": 0.5,
            "mix_tail_logprob": tails,
            # x2: a random context of 40 ids for the on-policy teacher (its own generator: the rows stay as they were)
            "x2_token_ids": x2_context(first_char, vocab, i),
            "meta": json.dumps({"fixture": True}),
        })
    if not with_x2:  # as a harvest from before the column was written
        rows = [{k: v for k, v in r.items() if k != "x2_token_ids"} for r in rows]
    folder.mkdir(parents=True, exist_ok=True)
    for shard, start in enumerate(range(0, n_rows, shard_rows)):
        (folder / shard_name(shard)).write_bytes(encode_shard(rows[start : start + shard_rows]))
    # The completion marker the harvest writes last: train and export check the shards against it.
    paths = shard_paths(folder)
    records = {p.name: shard_record(p) for p in paths}
    manifest = {"rows": n_rows, "shards": [p.name for p in paths], "shard_files": records}
    (folder / "manifest.json").write_text(json.dumps(manifest))
