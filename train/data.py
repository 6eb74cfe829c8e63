"""Harvest rows -> student examples [x ‖ y] with the stored sparse teacher at every token of y, and their collator."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from redumix.data.chat import prompt_ids, template_pieces
from redumix.data.prompts import Message, attempt_messages, redo_messages, reflect_messages
from redumix.data.shards import load_shards
from redumix.train.config import RowFilter, Target

EXAMPLE_COLUMNS = ("id", "input_ids", "prompt_length", "teacher_ids", "teacher_logprobs", "teacher_tail")
TEACHER_COLUMNS = ("redo_token_ids", "mix_topk_ids", "mix_topk_logprobs", "mix_tail_logprob")


def load_harvest(folder: Path) -> Dataset:
    """All rows of RUN_DIR/harvest, through the shard reader of data/."""
    return load_shards(Path(folder))


# `train.rows` by name: which harvested rows are learned. An unknown verdict (None) never passes a filter.
ROW_FILTERS: dict[str, Callable[[dict], bool]] = {
    "improved": lambda r: r["original_correct"] is False and r["redo_correct"] is True,
    "redo_correct": lambda r: r["redo_correct"] is True,
    "original_correct": lambda r: r["original_correct"] is True,  # the `rft` evidence arm's rows
}


def filter_rows(rows: Dataset, which: RowFilter) -> Dataset:
    """The rows `which` keeps (`all`: every row)."""
    return rows if which == "all" else rows.filter(ROW_FILTERS[which])


def is_heldout(example_id: str, fraction: float) -> bool:
    """A row is held out by a hash of its id: the same rows on every rerun and every rank, whatever the order."""
    digest = hashlib.sha256(example_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_heldout(rows: Dataset, fraction: float) -> tuple[Dataset, Dataset]:
    flags = [is_heldout(i, fraction) for i in rows["id"]]
    train = [i for i, held in enumerate(flags) if not held]
    held = [i for i, held in enumerate(flags) if held]
    return rows.select(train), rows.select(held)


def build_examples(
    rows: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    target: Target = "mixture",
    solutions: dict[str, str] | None = None,
    with_contexts: bool = False,
) -> Dataset:
    """Tokenise x with the chat template and append y; keep the teacher for each kept token of y.

    target 'mixture' appends the stored redo ids with the stored top-k of p_mix. The hard-label targets append a
    text ('redo', 'gold' from `solutions` by id, or 'original') closed by the template's end-of-turn token, with a
    one-hot teacher: the same loss is then cross-entropy, so every arm of `redumix evidence` trains one code path.
    with_contexts keeps x2's ids and λ for the on-policy teacher. Rows whose prompt alone fills max_length, or
    whose y is empty, are dropped (there is nothing to learn).
    """
    has_tail = "mix_tail_logprob" in rows.column_names  # absent in shards of earlier versions
    if with_contexts and "x2_token_ids" not in rows.column_names:
        raise ValueError("train.policy=on_policy needs each row's x2 ids (column x2_token_ids), which harvests from "
                         "before it lack; harvest again into a new run folder")
    end_of_turn = end_of_turn_ids(tokenizer)

    def encode(row: dict[str, Any]) -> dict[str, Any]:
        prompt = prompt_ids(tokenizer, attempt_messages(row["prompt"]))
        room = max(0, max_length - len(prompt))
        if target == "mixture":
            example = {"input_ids": prompt + list(row["redo_token_ids"][:room]), "prompt_length": len(prompt)}
            example.update(_stored_teacher(row, room, has_tail))
        else:
            text = solutions[row["id"]] if target == "gold" else row[target]
            example = hard_example(prompt, text, end_of_turn, tokenizer, max_length)
        if with_contexts:
            example["x2_ids"] = list(row["x2_token_ids"])
            example["lam"] = float(row["lam"])
        return example

    if target == "gold":
        missing = [i for i in rows["id"] if i not in (solutions or {})]
        if missing:
            raise ValueError(f"train.target=gold: the task has no reference working for {len(missing)} rows "
                             f"(e.g. {missing[:3]})")
    keep_columns = {"id"}
    examples = rows.map(encode, remove_columns=[c for c in rows.column_names if c not in keep_columns])
    return examples.filter(lambda e: len(e["input_ids"]) > e["prompt_length"])


def hard_example(prompt: list[int], text: str, end_of_turn: list[int], tokenizer: PreTrainedTokenizerBase,
                 max_length: int) -> dict[str, Any]:
    """[prompt ‖ text ‖ end of turn] with a one-hot teacher on the text: the sparse loss is then cross-entropy."""
    room = max(0, max_length - len(prompt))
    y = (tokenizer(text, add_special_tokens=False)["input_ids"] + end_of_turn)[:room]
    return {"input_ids": prompt + y, "prompt_length": len(prompt), "teacher_ids": [[t] for t in y],
            "teacher_logprobs": [[0.0]] * len(y), "teacher_tail": [float("-inf")] * len(y)}


def skill_examples(rows: Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int) -> Dataset:
    """The reflection turn and the in-context redo of every row whose redo is right, as hard-label examples.

    Distilling x -> redo alone teaches the product of a reflection and never the reflecting, so each round's model
    reflects worse than the last (SCoRe's behaviour collapse). These rows keep the improvement operator trained:
    [x ‖ y1 ‖ r ‖ REFLECT] -> c, and x2 (as the harvest cached it) -> redo. Only rows where reflecting fixed the
    attempt or kept it right are taught; a reflection that broke a right answer is not.
    """
    end_of_turn = end_of_turn_ids(tokenizer)

    def encode(batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {key: [] for key in EXAMPLE_COLUMNS}
        for i, example_id in enumerate(batch["id"]):
            x, y1, r, c = batch["prompt"][i], batch["original"][i], batch["feedback"][i], batch["reflection"][i]
            x2 = list(batch["x2_token_ids"][i]) if "x2_token_ids" in batch else prompt_ids(
                tokenizer, redo_messages(x, y1, r, c))
            pairs = [(prompt_ids(tokenizer, reflect_messages(x, y1, r)), c), (x2, batch["redo"][i])]
            for kind, (prompt, text) in zip(("reflect", "redo-in-context"), pairs, strict=True):
                for key, value in hard_example(prompt, text, end_of_turn, tokenizer, max_length).items():
                    out[key].append(value)
                out["id"].append(f"{example_id}/{kind}")
        return out

    right = rows.filter(lambda r: r["redo_correct"] is True)
    examples = right.map(encode, batched=True, remove_columns=right.column_names)
    return examples.filter(lambda e: len(e["input_ids"]) > e["prompt_length"])


def conversation_examples(
    conversations: list[tuple[str, list[Message], tuple[int, ...]]],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    context_only: frozenset[int] = frozenset(),
) -> Dataset:
    """(id, messages, trained turn indices) -> one hard-label example per trained assistant turn, its prompt being
    the conversation before that turn (`train.replay`'s episodes). Target tokens in `context_only` get no teacher
    (an empty top-k): the collator leaves them out of the loss, as the embedded base's pretraining did."""
    end_of_turn = end_of_turn_ids(tokenizer)
    out: dict[str, list] = {key: [] for key in EXAMPLE_COLUMNS}
    for conversation_id, messages, trained in conversations:
        for turn in trained:
            if messages[turn]["role"] != "assistant":
                raise ValueError(f"conversation {conversation_id!r}: turn {turn} is a {messages[turn]['role']} "
                                 "turn; only assistant turns can be trained")
            example = hard_example(prompt_ids(tokenizer, messages[:turn]), messages[turn]["content"], end_of_turn,
                                   tokenizer, max_length)
            if context_only:
                kept = [step[0] not in context_only for step in example["teacher_ids"]]
                for key in ("teacher_ids", "teacher_logprobs"):
                    example[key] = [step if keep else [] for step, keep in zip(example[key], kept, strict=True)]
            for key, value in example.items():
                out[key].append(value)
            out["id"].append(f"{conversation_id}/turn-{turn}")
    examples = Dataset.from_dict(out)
    return examples.filter(lambda e: len(e["input_ids"]) > e["prompt_length"])


def _stored_teacher(row: dict[str, Any], keep: int, has_tail: bool) -> dict[str, Any]:
    for column in TEACHER_COLUMNS:
        if column in row and len(row[column]) != len(row["redo_token_ids"]):
            raise ValueError(
                f"harvest row {row['id']!r}: {column} has {len(row[column])} entries but redo_token_ids has "
                f"{len(row['redo_token_ids'])}; the shard is corrupt, delete it and rerun `redumix harvest`"
            )
    teacher = {"teacher_ids": row["mix_topk_ids"][:keep], "teacher_logprobs": row["mix_topk_logprobs"][:keep]}
    if has_tail:
        teacher["teacher_tail"] = row["mix_tail_logprob"][:keep]
    return teacher


def end_of_turn_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The token that closes an assistant turn in the chat template (what a redo ends on when it stops)."""
    pieces = template_pieces(tokenizer, [*attempt_messages("?"), {"role": "assistant", "content": "!"}])
    return pieces[1][:1]


@dataclass
class SparseTeacherCollator:
    """Pads a batch on the right. labels are the unshifted HF kind (-100 on prompt and padding); the teacher tensors
    are (B, T, k) over each row's T target tokens, with teacher_mask (B, T) marking real ones. A target step with an
    empty top-k is context only: its label is -100 and its mask False, so the loss and the token count skip it.
    A top-k shorter than the batch's k is padded with -inf log-probs, which the loss reads as "no such bucket".
    With the stored tail, teacher_tail (B, T) holds each target token's log tail mass.
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
            untrained = [t for t, step in enumerate(f["teacher_ids"]) if not step]  # context, not a target
            if untrained:
                labels[b, [p + t for t in untrained]] = -100
                teacher_mask[b, untrained] = False
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
        if all("x2_ids" in f for f in features):  # on-policy rows: x2 right-padded, with its lengths and λ
            x2_width = max(len(f["x2_ids"]) for f in features)
            out["x2_ids"] = torch.full((batch, x2_width), self.pad_token_id, dtype=torch.long)
            for b, f in enumerate(features):
                out["x2_ids"][b, : len(f["x2_ids"])] = torch.as_tensor(f["x2_ids"], dtype=torch.long)
            out["x2_lengths"] = torch.tensor([len(f["x2_ids"]) for f in features], dtype=torch.long)
            out["prompt_lengths"] = torch.tensor([f["prompt_length"] for f in features], dtype=torch.long)
            out["lam"] = torch.tensor([f["lam"] for f in features], dtype=torch.float32)
        return out
