"""`arith`: seeded multi-step arithmetic word problems with integer answers, and their solution texts.

A problem is a start value and 2-4 operations (`+ a`, `- a`, `* f`), told as a short story. Every canonical problem
(start value and operations; the names and nouns of the story do not count) falls into one of ten buckets by a
stable hash: bucket 0 is the `test` split, bucket 1 the `train` split that the harvest reads, and buckets 2-9 are
what `redumix embedded` pre-trains on (embedded/corpus.py). So the base never sees a held-out or harvested problem,
whatever the seeds.

Solutions come in two procedures of different reliability:
- a terse first attempt, one line per step (`54 * 3 = 162`), some with realistic slips;
- a long-hand check that splits tens and units (`54 * 3: 50 * 3 = 150, 4 * 3 = 12, 150 + 12 = 162`). Reflections,
  refine answers, the long-hand solutions asked for by LONGHAND and hidden `<|reflect|>` spans use it. Checking this
  way is more reliable than the terse line, so a redo conditioned on the check is more accurate than the attempt:
  that gap is what ReDuMix harvests.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from redumix.data import grading
from redumix.data.grading import extract_answer
from redumix.data.splits import bucket, distinct_problems, split_buckets
from redumix.data.task import Example, Split

Op = Literal["+", "-", "*"]
SPLIT_BUCKET = {"test": 0, "train": 1}  # every other bucket belongs to base pre-training
LINE = re.compile(r"(\d+) ([-+*]) (\d+) = (\d+)")  # one computation, terse or long-hand

_NAMES = [("Ava", "She"), ("Ben", "He"), ("Cleo", "She"), ("Dan", "He"), ("Eva", "She"), ("Finn", "He"),
          ("Gia", "She"), ("Hugo", "He"), ("Iris", "She"), ("Jack", "He"), ("Lena", "She"), ("Max", "He")]
_ITEMS = ["apples", "books", "coins", "shells", "stamps", "marbles", "cards", "beads", "pens", "stickers"]
_PLUS = ["{He} finds {n} more.", "{He} buys {n} more.", "{He} gets {n} more."]
_MINUS = ["{He} gives away {n}.", "{He} loses {n}.", "{He} sells {n}."]
_TIMES = ["Then {he} has {n} times as many.", "The pile grows to {n} times its size."]


# --- problems -----------------------------------------------------------------------------------------------------


@dataclass
class ArithConfig:
    """`task.arith`: how hard the problems are. The defaults are the design's second prototype; recipes/tiny.yaml is
    easier."""

    steps_min: int = field(default=2, metadata={"help": "Fewest operations in a problem."})
    steps_max: int = field(default=4, metadata={"help": "Most operations in a problem."})
    start_max: int = field(default=40, metadata={"help": "Largest starting value (smallest is 2)."})
    operand_max: int = field(default=40, metadata={"help": "Largest operand of + and -."})
    factor_max: int = field(default=9, metadata={"help": "Largest factor of * (smallest is 2)."})
    mul_value_max: int = field(default=99, metadata={"help": "* is used only on values up to this."})

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
class Step:
    op: Op
    operand: int


@dataclass(frozen=True)
class Problem:
    start: int
    steps: tuple[Step, ...]
    name: str = "Ava"
    pronoun: str = "She"
    item: str = "apples"
    phrasing: tuple[int, ...] = ()  # which sentence template tells each step

    @property
    def key(self) -> str:
        """The canonical problem: the arithmetic only, so a renamed story is the same problem."""
        return f"{self.start}" + "".join(f"{s.op}{s.operand}" for s in self.steps)

    @property
    def bucket(self) -> int:
        return bucket(self.key)

    def values(self) -> list[int]:
        """The running value before the first step and after each one."""
        values = [self.start]
        for step in self.steps:
            values.append(apply(values[-1], step.op, step.operand))
        return values

    @property
    def answer(self) -> int:
        return self.values()[-1]

    def text(self) -> str:
        he, him = self.pronoun, self.pronoun.lower()
        sentences = [f"{self.name} has {self.start} {self.item}."]
        for step, choice in zip(self.steps, self.phrasing or (0,) * len(self.steps), strict=True):
            templates = {"+": _PLUS, "-": _MINUS, "*": _TIMES}[step.op]
            sentences.append(templates[choice % len(templates)].format(He=he, he=him, n=step.operand))
        sentences.append(f"How many {self.item} does {self.name} have now?")
        return " ".join(sentences)


def apply(value: int, op: str, operand: int) -> int:
    if op == "+":
        return value + operand
    if op == "-":
        return value - operand
    if op == "*":
        return value * operand
    raise ValueError(f"unknown operation {op!r}")


def sample_problem(rng: random.Random, config: ArithConfig) -> Problem:
    """One problem: results stay positive, and `*` is used only on values up to mul_value_max."""
    value = rng.randint(2, config.start_max)
    start = value
    steps = []
    for _ in range(rng.randint(config.steps_min, config.steps_max)):
        ops: list[Op] = ["+"] + (["-"] if value >= 2 else []) + (["*"] if value <= config.mul_value_max else [])
        op = rng.choice(ops)
        if op == "+":
            operand = rng.randint(1, config.operand_max)
        elif op == "-":
            operand = rng.randint(1, min(config.operand_max, value - 1))
        else:
            operand = rng.randint(2, config.factor_max)
        steps.append(Step(op, operand))
        value = apply(value, op, operand)
    name, pronoun = rng.choice(_NAMES)
    phrasing = tuple(rng.randrange(6) for _ in steps)
    return Problem(start, tuple(steps), name, pronoun, rng.choice(_ITEMS), phrasing)


def problems_in_buckets(config: ArithConfig, buckets: set[int], stream: str, seed: int) -> Iterator[Problem]:
    """An endless, seeded stream of distinct problems whose canonical form hashes into `buckets`."""
    return distinct_problems("arith", stream, seed, buckets, lambda rng: sample_problem(rng, config),
                             lambda problem: problem.key, "the difficulty settings (task.arith: steps_*, start_max, "
                             "operand_max, factor_max)")


def arith_problems(config: ArithConfig, split: Split, n: int, seed: int) -> list[Problem]:
    buckets = split_buckets("arith", split, {name: {index} for name, index in SPLIT_BUCKET.items()})
    stream = problems_in_buckets(config, set(buckets), split, seed)
    return [next(stream) for _ in range(n)]


def arith_examples(config: ArithConfig, split: Split, n: int, seed: int, prompt_suffix: str = "") -> list[Example]:
    """The first n problems of a split, ids `arith-{split}-{index:06d}`; a larger n extends the same list."""
    return [
        Example(id=f"arith-{split}-{i:06d}", task="arith", prompt=p.text() + prompt_suffix,
                reference=str(p.answer))
        for i, p in enumerate(arith_problems(config, split, n, seed))
    ]


# --- solutions ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Line:
    """One terse line `left op right = result`; `result` may be a slip."""

    left: int
    op: Op
    right: int
    result: int

    @property
    def right_result(self) -> int:
        return apply(self.left, self.op, self.right)

    def text(self) -> str:
        return f"{self.left} {self.op} {self.right} = {self.result}"


def long_hand(left: int, op: str, right: int) -> str:
    """The careful way: split into tens and units. `47 + 38` -> `40 + 30 = 70, 7 + 8 = 15, 70 + 15 = 85`."""
    tens_l, units_l = left - left % 10, left % 10
    tens_r, units_r = right - right % 10, right % 10
    if op == "+":
        tens, units = tens_l + tens_r, units_l + units_r
        return f"{tens_l} + {tens_r} = {tens}, {units_l} + {units_r} = {units}, {tens} + {units} = {tens + units}"
    if op == "-":
        # Tens first, then the units without a borrow: down to the round ten, then the rest from it
        # (`42 - 4: 42 - 0 = 42, 42 - 2 = 40, 40 - 2 = 38`). A borrow is exactly the terse line's usual slip.
        middle = left - tens_r
        if units_r <= middle % 10 or middle % 10 == 0:
            return f"{left} - {tens_r} = {middle}, {middle} - {units_r} = {middle - units_r}"
        down, rest = middle % 10, units_r - middle % 10
        return (f"{left} - {tens_r} = {middle}, {middle} - {down} = {middle - down}, "
                f"{middle - down} - {rest} = {middle - units_r}")
    if op == "*":
        tens, units = tens_l * right, units_l * right
        return f"{tens_l} * {right} = {tens}, {units_l} * {right} = {units}, {tens} + {units} = {tens + units}"
    raise ValueError(f"unknown operation {op!r}")


def slip(rng: random.Random, line: Line) -> Line:
    """A realistic mistake in one line: a wrong units digit, a dropped or extra carry, or a mis-copied operand."""
    kind = rng.choice(["digit", "carry", "copy"])
    if kind == "copy" and line.right >= 10 and line.op != "*":
        digits = str(line.right)
        swapped = int(digits[::-1]) if digits[0] != digits[-1] else line.right + rng.choice([-1, 1])
        copied = Line(line.left, line.op, swapped, 0)
        if copied.right_result > 0 and swapped > 0:
            return Line(line.left, line.op, swapped, copied.right_result)
    true = line.right_result
    for _ in range(20):
        if kind == "carry":
            wrong = true + rng.choice([-10, 10]) * (10 if true >= 100 and rng.random() < 0.3 else 1)
        else:
            wrong = true - true % 10 + rng.choice([d for d in range(10) if d != true % 10])
        if wrong > 0 and wrong != true:
            return Line(line.left, line.op, line.right, wrong)
    return Line(line.left, line.op, line.right, true + 1)


def is_hard(left: int, op: str, right: int) -> bool:
    """A carry, a borrow or a two-digit product: where the terse line slips, and where a check pays."""
    if op == "+":
        return left % 10 + right % 10 >= 10
    if op == "-":
        return left % 10 < right % 10
    return left >= 10


def attempt_lines(problem: Problem, rng: random.Random, slips: set[int] = frozenset()) -> list[Line]:
    """The terse solution, with a slip in each line index in `slips`; later lines carry the wrong value on."""
    lines, value = [], problem.start
    for index, step in enumerate(problem.steps):
        line = Line(value, step.op, step.operand, apply(value, step.op, step.operand))
        if index in slips:
            line = slip(rng, line)
        lines.append(line)
        value = line.result
    return lines


def solution_text(lines: list[Line]) -> str:
    """Terse lines then the final-answer line that `grading.extract_answer` reads."""
    body = [line.text() for line in lines]
    return "\n".join([*body, f"The answer is {lines[-1].result}."])


def long_hand_solution(problem: Problem) -> str:
    """A whole solution done the careful way, one step per line (the PDR refine target)."""
    values = problem.values()
    steps = zip(values[:-1], problem.steps, strict=True)
    body = [f"{a} {s.op} {s.operand}: {long_hand(a, s.op, s.operand)}" for a, s in steps]
    return "\n".join([*body, f"The answer is {problem.answer}."])


def reflection_text(problem: Problem, attempt: list[Line]) -> str:
    """Re-derive every step long-hand from the problem (not from the attempt), judge each terse line, name the slip."""
    values = problem.values()
    out = ["I check each line the long way."]
    first_wrong = None
    for index, step in enumerate(problem.steps):
        a, result = values[index], values[index + 1]
        check = f"Line {index + 1}: {a} {step.op} {step.operand}: {long_hand(a, step.op, step.operand)}."
        written = attempt[index].result if index < len(attempt) else None
        if written == result:
            out.append(f"{check} Right.")
        else:
            out.append(f"{check} Wrong, I wrote {written}." if written is not None else f"{check} Missing.")
            first_wrong = index + 1 if first_wrong is None else first_wrong
    if first_wrong is None:
        out.append(f"All lines are right, so the answer {problem.answer} stands.")
    else:
        out.append(f"The first mistake is in line {first_wrong}, so the answer should be {problem.answer}.")
    return "\n".join(out)


# --- the task -------------------------------------------------------------------------------------------------------


class ArithTask:
    """`arith` through the Task seam: generated examples and GSM8K-style grading."""

    name = "arith"

    def __init__(self, config: ArithConfig, seed: int, prompt_suffix: str = "") -> None:
        self.config = config
        self.seed = seed
        self.prompt_suffix = prompt_suffix

    def examples(self, split: Split, n: int | None) -> list[Example]:
        if n is None:
            raise ValueError("task 'arith' is generated: set how many examples (harvest.n / eval.n)")
        return arith_examples(self.config, split, n, self.seed, self.prompt_suffix)

    def solutions(self, split: Split, n: int) -> dict[str, str]:
        """The terse solution with no slip: what the base's training text teaches for a first attempt."""
        problems = arith_problems(self.config, split, n, self.seed)
        return {f"arith-{split}-{i:06d}": solution_text(attempt_lines(p, random.Random(0))) for i, p in
                enumerate(problems)}

    # Graded as GSM8K is: the final number of a completion against the gold one.
    answer = staticmethod(extract_answer)
    is_correct = staticmethod(grading.grade)
    feedback = staticmethod(grading.feedback)
