"""The arith task: seeded, disjoint splits, right answers, right long-hand checks, and well-formed training text."""

from __future__ import annotations

import itertools
import random
import re

import pytest

from redumix.data.arith import (
    LINE,
    SPLIT_BUCKET,
    ArithConfig,
    Problem,
    Step,
    arith_examples,
    arith_problems,
    attempt_lines,
    is_hard,
    long_hand,
    long_hand_solution,
    problems_in_buckets,
    reflection_text,
    slip,
    solution_text,
)
from redumix.data.grading import extract_answer, is_correct
from redumix.data.prompts import CRITIQUE, LONGHAND, REDO, REFINE, REFLECT
from redumix.data.splits import BUCKETS, bucket
from redumix.data.tasks import TaskConfig, make_task
from redumix.embedded.corpus import CorpusSpec, corpus_episodes, refine_checks, workspace_order
from redumix.embedded.vocab import REFLECT_CLOSE, REFLECT_OPEN

WORDS = {"more": "+", "away": "-", "loses": "-", "sells": "-", "times": "*"}


def solve_from_text(prompt: str) -> int:
    """An independent solver that reads the story sentence by sentence (no use of data/arith.py's arithmetic)."""
    sentences = [s for s in prompt.split(".") if s.strip()]
    value = int(re.search(r"has (\d+)", sentences[0]).group(1))
    for sentence in sentences[1:]:
        numbers = re.findall(r"\d+", sentence)
        if not numbers:
            continue
        n = int(numbers[0])
        if "times" in sentence:
            value *= n
        elif "more" in sentence:
            value += n
        else:
            value -= n
    return value


def test_examples_are_seeded_and_prefix_stable():
    config = ArithConfig()
    a = arith_examples(config, "test", 50, seed=0)
    assert a == arith_examples(config, "test", 50, seed=0)
    assert arith_examples(config, "test", 20, seed=0) == a[:20]
    assert arith_examples(config, "test", 50, seed=1) != a
    assert [e.id for e in a[:2]] == ["arith-test-000000", "arith-test-000001"]
    assert make_task(TaskConfig(arith=config), seed=0).examples("test", 50) == a


def test_answers_are_right():
    for example in arith_examples(ArithConfig(), "train", 300, seed=3):
        assert example.task == "arith"
        assert int(example.reference) == solve_from_text(example.prompt) > 0


def test_splits_are_disjoint_from_each_other_and_from_the_base_corpus():
    config = ArithConfig()
    keys = {split: {p.key for p in arith_problems(config, split, 400, seed=0)} for split in ("train", "test")}
    assert not keys["train"] & keys["test"]
    assert len(keys["test"]) == 400  # no duplicate inside a split
    # Another seed draws other problems, but never across the bucket boundary.
    assert not {p.key for p in arith_problems(config, "test", 200, seed=7)} & keys["train"]
    base_buckets = set(range(BUCKETS)) - set(SPLIT_BUCKET.values())
    base = {p.key for p in itertools.islice(problems_in_buckets(config, base_buckets, "base", 0), 3000)}
    assert not base & (keys["train"] | keys["test"])


def test_the_split_stream_draws_the_same_problems_and_names_the_splits():
    # The first test problems of seed 0, as the stream drew them before data/splits.py held it: a changed draw would
    # move every split, the shipped model's corpus and every harvest.
    assert [p.key for p in arith_problems(ArithConfig(), "test", 3, seed=0)] == ["3-1-1*8-4", "7+20+33", "37*4-8"]
    assert all(p.bucket == bucket(p.key) == 0 for p in arith_problems(ArithConfig(), "test", 20, seed=3))
    with pytest.raises(ValueError, match="arith has splits 'train' and 'test', not 'valid'"):
        arith_problems(ArithConfig(), "valid", 1, seed=0)


def test_difficulty_settings_are_obeyed():
    config = ArithConfig(steps_min=3, steps_max=3, start_max=9, operand_max=5, factor_max=3, mul_value_max=20)
    for problem in arith_problems(config, "train", 200, seed=0):
        assert len(problem.steps) == 3 and 2 <= problem.start <= 9
        values = problem.values()
        for value, step in zip(values, problem.steps, strict=False):
            if step.op == "*":
                assert 2 <= step.operand <= 3 and value <= 20
            else:
                assert 1 <= step.operand <= 5
        assert min(values) > 0


def test_too_few_problems_is_a_clear_error():
    config = ArithConfig(steps_min=1, steps_max=1, start_max=2, operand_max=2, factor_max=2, mul_value_max=2)
    with pytest.raises(ValueError, match="too few distinct problems"):
        arith_problems(config, "test", 50, seed=0)


@pytest.mark.parametrize("op", ["+", "-", "*"])
def test_long_hand_checks_are_arithmetically_right(op):
    rng = random.Random(op)
    for _ in range(500):
        left = rng.randint(1, 999)
        right = rng.randint(2, 9) if op == "*" else rng.randint(1, left if op == "-" else 40)
        text = long_hand(left, op, right)
        lines = LINE.findall(text)
        assert len(lines) >= 2
        for a, o, b, r in lines:
            assert eval(f"{a} {o} {b}") == int(r), text
        assert int(lines[-1][3]) == eval(f"{left} {op} {right}")
    assert long_hand(47, "+", 38) == "40 + 30 = 70, 7 + 8 = 15, 70 + 15 = 85"
    assert long_hand(54, "*", 3) == "50 * 3 = 150, 4 * 3 = 12, 150 + 12 = 162"
    assert long_hand(42, "-", 14) == "42 - 10 = 32, 32 - 2 = 30, 30 - 2 = 28"  # no borrow anywhere


def test_slips_are_wrong_and_propagate():
    problem = Problem(23, (Step("+", 17), Step("*", 3), Step("-", 9)))
    rng = random.Random(0)
    for _ in range(200):
        lines = attempt_lines(problem, rng, slips={1})
        assert lines[0].result == 40
        assert lines[1].result != lines[1].right_result or lines[1].right != 3 or lines[1].left != 40
        assert lines[2].left == lines[1].result  # the next line carries the wrong value on
        assert lines[2].result == lines[2].right_result
        assert not is_correct(solution_text(lines), str(problem.answer))
    clean = solution_text(attempt_lines(problem, rng))
    assert clean == "23 + 17 = 40\n40 * 3 = 120\n120 - 9 = 111\nThe answer is 111."
    assert extract_answer(clean) == "111"


def test_reflection_names_the_wrong_line_and_rederives_every_step():
    problem = Problem(23, (Step("+", 17), Step("*", 3), Step("-", 9)))
    lines = attempt_lines(problem, random.Random(1), slips={1})
    text = reflection_text(problem, lines)
    assert "Line 1: 23 + 17: 20 + 10 = 30, 3 + 7 = 10, 30 + 10 = 40. Right." in text
    assert f"Wrong, I wrote {lines[1].result}." in text
    assert "The first mistake is in line 2, so the answer should be 111." in text
    for a, o, b, r in LINE.findall(text):
        assert eval(f"{a} {o} {b}") == int(r)
    right = reflection_text(problem, attempt_lines(problem, random.Random(1)))
    assert "Wrong" not in right and right.endswith("so the answer 111 stands.")
    assert long_hand_solution(problem).endswith("120 - 0 = 120, 120 - 9 = 111\nThe answer is 111.")


def test_corpus_episodes_use_the_pipeline_turns():
    spec = CorpusSpec(check_span_rate=0.5)
    episodes = list(itertools.islice(corpus_episodes(ArithConfig(), spec, seed=0), 400))
    assert episodes == list(itertools.islice(corpus_episodes(ArithConfig(), spec, seed=0), 400))
    kinds = {e.kind for e in episodes}
    assert kinds == {"solution", "reflection", "critique", "refine", "longhand"}
    for e in episodes:
        roles = [m["role"] for m in e.messages]
        assert roles[0] == "user" and roles[-1] == "assistant"
        assert all(roles[i] == "assistant" for i in e.trained)
        final = e.messages[-1]["content"]
        if e.kind == "reflection":
            assert e.messages[2]["content"].endswith(REFLECT) and e.messages[4]["content"] == REDO
            assert e.messages[2]["content"].startswith("Your final answer ")
            assert e.trained == (3, 5)  # the (possibly wrong) attempt is context only
        if e.kind in ("reflection", "refine", "longhand"):
            question = e.messages[0]["content"].split("\nEarlier solutions:")[0].removesuffix("\n" + LONGHAND)
            assert is_correct(final, str(solve_from_text(question)))
        if e.kind == "longhand":
            assert e.messages[0]["content"].endswith("\n" + LONGHAND) and final.count(":") >= 2
        if e.kind in ("refine", "longhand", "reflection"):
            for a, o, b, r in LINE.findall(final):  # every line the model is taught to write is right
                assert eval(f"{a} {o} {b}") == int(r)
        if e.kind == "critique":
            assert e.messages[2]["content"] == CRITIQUE
            assert re.fullmatch(r"Your final answer -?\d+ is (correct|wrong)\.", final)
        if e.kind == "refine":
            assert e.messages[0]["content"].endswith(REFINE) and "Earlier solutions:\nSolution 1:\n" in (
                e.messages[0]["content"]
            )


def solutions_only(**rates: float) -> CorpusSpec:
    return CorpusSpec(mix_reflection=0.0, mix_critique=0.0, mix_refine=0.0, mix_longhand=0.0, **rates)


def test_hidden_check_spans_are_placed_after_equals_and_right():
    spec = solutions_only(slip_rate=0.0, check_span_rate=1.0)
    found = 0
    for episode in itertools.islice(corpus_episodes(ArithConfig(), spec, seed=0), 50):
        text = episode.messages[1]["content"]
        spans = re.findall(r"(\d+) ([-+*]) (\d+) = " + re.escape(REFLECT_OPEN) + r"(.*?)" + re.escape(REFLECT_CLOSE)
                           + r"(\d+)", text)
        assert len(spans) == text.count(REFLECT_OPEN)
        found += len(spans)
        for a, op, b, check, result in spans:
            assert int(result) == eval(f"{a} {op} {b}")
            assert check == long_hand(int(a), op, int(b))
    assert found > 50


def _line_rates(spec: CorpusSpec, seen, n: int = 3000) -> tuple[float, float]:
    """(share of hard lines with the property, share of easy lines with it) over n solution episodes."""
    counts = {True: [0, 0], False: [0, 0]}
    for episode in itertools.islice(corpus_episodes(ArithConfig(), spec, seed=1), n):
        for line in episode.messages[1]["content"].splitlines()[:-1]:
            a, op, b = re.match(r"(-?\d+) ([-+*]) (\d+) = ", line).groups()
            hard = is_hard(int(a), op, int(b))
            counts[hard][0] += seen(line, int(a), op, int(b))
            counts[hard][1] += 1
    return counts[True][0] / counts[True][1], counts[False][0] / counts[False][1]


def test_check_spans_fall_mostly_on_hard_lines_and_slips_do_not():
    """Training puts checks where a carry, a borrow or a two-digit product makes the terse line unsure."""
    checks = solutions_only(slip_rate=0.0, check_span_rate=0.2)
    hard, easy = _line_rates(checks, lambda line, *_: REFLECT_OPEN in line)
    assert hard > 3 * easy > 0
    slips = solutions_only(slip_rate=1.0, check_span_rate=0.0)
    hard, easy = _line_rates(slips, lambda line, a, op, b: int(line.rsplit(" ", 1)[1]) != eval(f"{a} {op} {b}"))
    assert 0.5 < hard / easy < 2


def test_refine_checks_spend_long_hand_where_the_drafts_disagree():
    problem = Problem(12, (Step("+", 9), Step("*", 3)))  # 12 + 9 = 21, 21 * 3 = 63
    right = attempt_lines(problem, random.Random(0))
    wrong = [right[0], slip(random.Random(3), right[1])]
    assert wrong[1].result != 63
    text = refine_checks(problem, workspace_order([wrong, right, wrong]))
    assert text.splitlines() == [
        "I check Solution 1 line by line.",
        "Line 1: 12 + 9 = 21. All agree.",
        f"Line 2: 21 * 3: {long_hand(21, '*', 3)}. Wrong, I wrote {wrong[1].result}.",
    ]
    # One draft is Sequential Refinement: every line is checked the long way.
    alone = refine_checks(problem, [right]).splitlines()
    assert alone[1] == f"Line 1: 12 + 9: {long_hand(12, '+', 9)}. Right." and alone[2].endswith("Right.")
    # Two wrong drafts that agree on line 2 still get it checked, since they are wrong.
    assert "Wrong" in refine_checks(problem, [wrong, wrong])


def test_workspace_order_ranks_answers_by_votes_like_pdr():
    problem = Problem(12, (Step("+", 9), Step("*", 3)))
    right = attempt_lines(problem, random.Random(0))
    wrong = [right[0], slip(random.Random(3), right[1])]
    assert workspace_order([right, wrong, wrong]) == [wrong, right]
    assert workspace_order([right, wrong]) == [right, wrong]


