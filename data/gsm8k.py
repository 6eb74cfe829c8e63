"""`gsm8k`: grade-school math word problems read from JSON Lines (`question`, `answer` ending in `#### N`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from redumix.common.files import read_jsonl
from redumix.data import grading
from redumix.data.grading import as_number, extract_answer
from redumix.data.task import Example, Split


@dataclass
class Gsm8kConfig:
    """`task.gsm8k`: where the problems are read from."""

    path: str = field(
        default="../shared/data/gsm8k",
        metadata={"help": "Folder holding train.jsonl and test.jsonl (question/answer lines)."},
    )


def gold_answer(answer: str) -> str:
    """The number after GSM8K's `####`, commas stripped (`"... #### 1,234"` -> `"1234"`)."""
    return answer.rpartition("####")[2].strip().replace(",", "")


def load_gsm8k(path: Path, prompt_suffix: str = "") -> list[Example]:
    if not path.is_file():
        raise FileNotFoundError(
            f"GSM8K file not found: {path} (set task.gsm8k.path to the folder holding {path.name})"
        )
    examples = []
    for line_no, row in read_jsonl(path):
        where = f"{path}:{line_no}"
        if not isinstance(row, dict) or not isinstance(row.get("question"), str) or "answer" not in row:
            raise ValueError(
                f"{where}: expected an object with 'question' and 'answer' strings; fix or remove that line"
            )
        if not row["question"].strip():
            raise ValueError(f"{where}: 'question' is empty, so there is no prompt to answer; fix or remove that line")
        reference = gold_answer(str(row["answer"]))
        if as_number(reference) is None:
            raise ValueError(
                f"{where}: 'answer' must end in '#### N' with N a number, but its gold answer is {reference[:40]!r}; "
                "fix or remove that line"
            )
        examples.append(
            Example(
                id=f"gsm8k-{path.stem}-{line_no - 1:05d}",
                task="gsm8k",
                prompt=row["question"].strip() + prompt_suffix,
                reference=reference,
            )
        )
    if not examples:
        raise ValueError(f"{path}: no examples (the file holds no JSON lines); set task.gsm8k.path to a folder whose "
                         f"{path.name} has one 'question'/'answer' object a line")
    return examples


class Gsm8kTask:
    name = "gsm8k"

    def __init__(self, config: Gsm8kConfig, seed: int = 0, prompt_suffix: str = "") -> None:
        self.config = config  # the seed is not used: the problems are the files'
        self.prompt_suffix = prompt_suffix
        self._splits: dict[str, list[Example]] = {}  # read once per split

    def examples(self, split: Split, n: int | None) -> list[Example]:
        if split not in self._splits:
            self._splits[split] = load_gsm8k(Path(self.config.path) / f"{split}.jsonl", self.prompt_suffix)
        examples = self._splits[split]
        return examples if n is None else examples[:n]

    def solutions(self, split: Split, n: int) -> dict[str, str]:
        """GSM8K's own worked answers (`<<48/2=24>>` calculator notes and all), ending in `#### N`."""
        path = Path(self.config.path) / f"{split}.jsonl"
        ids = [e.id for e in self.examples(split, n)]
        answers = [str(row["answer"]) for _, row in read_jsonl(path)]
        return dict(zip(ids, answers[: len(ids)], strict=True))

    # Graded as GSM8K is: the final number of a completion against the gold one.
    answer = staticmethod(extract_answer)
    is_correct = staticmethod(grading.grade)
    feedback = staticmethod(grading.feedback)
