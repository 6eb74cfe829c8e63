"""Harvest rows -> student examples [x ‖ y] with the stored sparse teacher at every token of y, and their collator."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from redumix.data.chat import prompt_ids
from redumix.data.prompts import attempt_messages
from redumix.data.shards import load_shards
from redumix.train.config import RowFilter

TEACHER_COLUMNS = ("redo_token_ids", "mix_topk_ids", "mix_topk_logprobs", "mix_tail_logprob")


def load_harvest(folder: Path) -> Dataset:
    """All rows of RUN_DIR/harvest, through the shard reader of data/."""
    return load_shards(Path(folder))


def filter_rows(rows: Dataset, which: RowFilter) -> Dataset:
    """`all`, `improved` (original wrong, redo right) or `redo_correct`. An unknown verdict (None) never passes."""
    if which == "all":
        return rows
    if which == "improved":
        return rows.filter(lambda r: r["original_correct"] is False and r["redo_correct"] is True)
    return rows.filter(lambda r: r["redo_correct"] is True)


def is_heldout(example_id: str, fraction: float) -> bool:
    """A row is held out by a hash of its id: the same rows on every rerun and every rank, whatever the order."""
    digest = hashlib.sha256(example_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_heldout(rows: Dataset, fraction: float) -> tuple[Dataset, Dataset]:
    flags = [is_heldout(i, fraction) for i in rows["id"]]
    train = [i for i, held in enumerate(flags) if not held]
    held = [i for i, held in enumerate(flags) if held]
    return rows.select(train), rows.select(held)


def build_examples(rows: Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int) -> Dataset:
    """Tokenise x with the chat template and append y's stored ids; keep the teacher for each kept token of y.

    Rows whose prompt alone fills max_length, or whose redo is empty, are dropped (there is nothing to learn).
    """

    has_tail = "mix_tail_logprob" in rows.column_names  # absent in shards of earlier versions

    def encode(row: dict[str, Any]) -> dict[str, Any]:
        prompt = prompt_ids(tokenizer, attempt_messages(row["prompt"]))
        keep = max(0, min(len(row["redo_token_ids"]), max_length - len(prompt)))
        for column in TEACHER_COLUMNS:
            if column in row and len(row[column]) != len(row["redo_token_ids"]):
                raise ValueError(
                    f"harvest row {row['id']!r}: {column} has {len(row[column])} entries but redo_token_ids has "
                    f"{len(row['redo_token_ids'])}; the shard is corrupt, delete it and rerun `redumix harvest`"
                )
        example = {
            "input_ids": prompt + list(row["redo_token_ids"][:keep]),
            "prompt_length": len(prompt),
            "teacher_ids": row["mix_topk_ids"][:keep],
            "teacher_logprobs": row["mix_topk_logprobs"][:keep],
        }
        if has_tail:
            example["teacher_tail"] = row["mix_tail_logprob"][:keep]
        return example

    keep_columns = {"id"}
    examples = rows.map(encode, remove_columns=[c for c in rows.column_names if c not in keep_columns])
    return examples.filter(lambda e: len(e["input_ids"]) > e["prompt_length"])


@dataclass
class SparseTeacherCollator:
    """Pads a batch on the right. labels are the unshifted HF kind (-100 on prompt and padding); the teacher tensors
    are (B, T, k) over each row's T target tokens, with teacher_mask (B, T) marking real ones. A top-k shorter than
    the batch's k is padded with -inf log-probs, which the loss reads as "no such bucket". With the stored tail,
    teacher_tail (B, T) holds each target token's log tail mass.
    """

    pad_token_id: int

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(f["input_ids"]) for f in features)
        targets = max(len(f["input_ids"]) - f["prompt_length"] for f in features)
        k = max((len(step) for f in features for step in f["teacher_ids"]), default=1)
        batch = len(features)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        teacher_ids = torch.zeros((batch, targets, k), dtype=torch.long)
        teacher_logprobs = torch.full((batch, targets, k), float("-inf"), dtype=torch.float32)
        teacher_mask = torch.zeros((batch, targets), dtype=torch.bool)
        with_tail = all("teacher_tail" in f for f in features)
        teacher_tail = torch.zeros((batch, targets), dtype=torch.float32)
        for b, f in enumerate(features):
            ids = torch.as_tensor(f["input_ids"], dtype=torch.long)
            n, p = len(ids), f["prompt_length"]
            input_ids[b, :n] = ids
            attention_mask[b, :n] = 1
            labels[b, p:n] = ids[p:]
            teacher_mask[b, : n - p] = True
            if with_tail:
                teacher_tail[b, : n - p] = torch.as_tensor(f["teacher_tail"], dtype=torch.float32)
            try:  # the usual case: every step has the same k, one tensor per row
                step_ids = torch.tensor(f["teacher_ids"], dtype=torch.long)
                step_logprobs = torch.tensor(f["teacher_logprobs"], dtype=torch.float32)
                teacher_ids[b, : n - p, : step_ids.shape[1]] = step_ids
                teacher_logprobs[b, : n - p, : step_logprobs.shape[1]] = step_logprobs
            except ValueError:  # ragged top-k (a step with fewer than k ids)
                for t, (ids_t, logprobs_t) in enumerate(zip(f["teacher_ids"], f["teacher_logprobs"], strict=True)):
                    teacher_ids[b, t, : len(ids_t)] = torch.as_tensor(ids_t, dtype=torch.long)
                    teacher_logprobs[b, t, : len(logprobs_t)] = torch.as_tensor(logprobs_t, dtype=torch.float32)
        out = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
            "teacher_ids": teacher_ids,
            "teacher_logprobs": teacher_logprobs,
            "teacher_mask": teacher_mask,
        }
        if with_tail:
            out["teacher_tail"] = teacher_tail
        return out
