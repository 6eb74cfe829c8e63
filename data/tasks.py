"""Tasks: load examples with stable ids and gold answers. `arith` is generated from a seed, `gsm8k` read from JSONL."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Split = Literal["train", "test"]


@dataclass
class TaskConfig:
    name: Literal["arith", "gsm8k"] = field(default="arith", metadata={"help": "Task to harvest and evaluate."})
    path: str = field(
        default="../shared/data/gsm8k",
        metadata={"help": "gsm8k only: folder holding train.jsonl and test.jsonl (question/answer lines)."},
    )
    prompt_suffix: str = field(
        default="",
        metadata={"help": "Text appended to every question, e.g. an answer-format instruction for a real model."},
    )
    # arith difficulty (data/arith.py). The defaults are the ones the DESIGN prototype measured.
    steps_min: int = field(default=2, metadata={"help": "arith: fewest operations in a problem."})
    steps_max: int = field(default=4, metadata={"help": "arith: most operations in a problem."})
    start_max: int = field(default=40, metadata={"help": "arith: largest starting value (smallest is 2)."})
    operand_max: int = field(default=40, metadata={"help": "arith: largest operand of + and -."})
    factor_max: int = field(default=9, metadata={"help": "arith: largest factor of * (smallest is 2)."})
    mul_value_max: int = field(default=99, metadata={"help": "arith: * is used only on values up to this."})

    def __post_init__(self) -> None:
        problems = []
        if not 1 <= self.steps_min <= self.steps_max:
            problems.append(f"need 1 <= steps_min <= steps_max, got {self.steps_min}, {self.steps_max}")
        for name in ("start_max", "operand_max", "mul_value_max"):
            if getattr(self, name) < 2:
                problems.append(f"{name} must be at least 2, got {getattr(self, name)}")
        if self.factor_max < 2:
            problems.append(f"factor_max must be at least 2, got {self.factor_max}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True)
class Example:
    id: str
    task: str
    prompt: str
    reference: str


def load_examples(config: TaskConfig, split: Split, n: int | None, seed: int = 0) -> list[Example]:
    """The first n examples of a split, in a stable order, so a rerun or another rank sees the same list."""
    if config.name == "gsm8k":
        examples = load_gsm8k(Path(config.path) / f"{split}.jsonl", config.prompt_suffix)
        return examples if n is None else examples[:n]
    from redumix.data.arith import arith_examples

    if n is None:
        raise ValueError("task 'arith' is generated: set how many examples (harvest.n / eval.n)")
    return arith_examples(config, split, n, seed)


def jsonl_objects(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of every non-blank line; a bad line is an error naming the file and line."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({exc.msg}); fix or remove that line") from exc


def load_gsm8k(path: Path, prompt_suffix: str = "") -> list[Example]:
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K file not found: {path} (set task.path to the folder holding {path.name})")
    examples = []
    for line_no, row in jsonl_objects(path):
        if not isinstance(row, dict) or not isinstance(row.get("question"), str) or "answer" not in row:
            raise ValueError(f"{path}:{line_no}: expected an object with 'question' and 'answer' strings")
        reference = str(row["answer"]).rpartition("####")[2].strip().replace(",", "")
        examples.append(
            Example(
                id=f"gsm8k-{path.stem}-{line_no - 1:05d}",
                task="gsm8k",
                prompt=row["question"].strip() + prompt_suffix,
                reference=reference,
            )
        )
    return examples


def read_jsonl_by_id(path: Path, field_name: str) -> dict[str, str]:
    """A human feedback file: one JSON object per line with 'id' and `field_name`. Errors name file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"feedback file not found: {path}")
    out: dict[str, str] = {}
    for line_no, row in jsonl_objects(path):
        if not isinstance(row, dict) or not isinstance(row.get("id"), str) or not isinstance(row.get(field_name), str):
            raise ValueError(f"{path}:{line_no}: expected an object with string keys 'id' and {field_name!r}")
        if row["id"] in out:
            raise ValueError(f"{path}:{line_no}: id {row['id']!r} appears twice")
        out[row["id"]] = row[field_name]
    return out
