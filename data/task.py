"""The Task seam: what every stage needs from a task, and nothing else.

A task gives examples with stable ids, reads a final answer out of a completion, grades it, and phrases a
verifier's feedback that never reveals the gold answer. A task that can teach the embedded base (`arith`) also
yields its training episodes. Stages take a `Task` and never import grading themselves; `data/tasks.py` is the one
place that picks a task by name, and composes the `task` config section from each task's own settings.

A task may also give named sub-scores: `sub_scores(text, example) -> dict[str, bool]`, a verdict per named check
that applies to the example (`constraints` gives one per constraint, by kind). It is optional, so it is not in the
protocol: eval keeps them in each record, and its report gives each name's pass rate over the examples it applies
to. A task with reference solutions may give `privileged_feedback(text, example)`: the verifier's feedback and the
reference (or a hint cut from it), the privileged context a harvest on train problems shows in x2
(`redumix.feedback=reference`); it must refuse a test problem. A task that runs the model's code may give
`grader() -> dict`: what graded it (the sandbox's layers on this host, the limits), which the harvest's manifest
and eval's report record. A task whose checker a reply can pass without answering may give
`blind_replies(example) -> dict[str, str]`: named replies built without the request (`constraints`: a template from
the constraints alone, and `ok`), which eval's report grades on greedy's examples as baselines, at no model call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

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


def grader_of(task: Task) -> dict[str, Any] | None:
    """What graded a task's replies (`grader()`, optional: the `code` task's sandbox layers and limits), else None."""
    grader = getattr(task, "grader", None)
    return grader() if grader is not None else None
