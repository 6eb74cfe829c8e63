"""The Task seam: what every stage needs from a task, and nothing else.

A task gives examples with stable ids, reads a final answer out of a completion, grades it, and phrases a
verifier's feedback that never reveals the gold answer. A task that can teach the embedded base (`arith`) also
yields its training episodes. Stages take a `Task` and never import grading themselves; `data/tasks.py` is the one
place that picks a task by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

Split = Literal["train", "test"]


@dataclass(frozen=True)
class Example:
    id: str
    task: str
    prompt: str
    reference: str  # the gold answer, "" when the task has none


class Task(Protocol):
    name: str

    def examples(self, split: Split, n: int | None) -> list[Example]:
        """The first n examples of a split in a stable order, so a rerun or another rank sees the same list."""
        ...

    def answer(self, text: str) -> str | None:
        """The final answer a completion gives, or None."""
        ...

    def is_correct(self, text: str, example: Example) -> bool: ...

    def feedback(self, text: str, example: Example) -> str:
        """What a verifier tells the model about its completion. It must not reveal the gold answer."""
        ...

    def solutions(self, split: Split, n: int) -> dict[str, str]:
        """The reference working of the first n examples of a split, by id (the gold-SFT control trains on it)."""
        ...


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
    # arith difficulty (data/arith.py). The defaults are the design's second prototype; recipes/tiny.yaml is easier.
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
