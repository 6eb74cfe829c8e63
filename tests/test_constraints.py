"""The `constraints` task (data/constraints.py): each checker on hand-made passing and failing texts, seeded prompts
split by a stable hash, no contradictory constraints drawn, strict grading, feedback that names each failure and only
those, the pass rate per kind in eval's report, and its recipe run unchanged on tiny random Qwen2 and Llama models."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from redumix.data.arith import ArithConfig, ArithTask
from redumix.data.constraint_checks import template_reply as template_for
from redumix.data.constraints import (
    KINDS,
    TOPICS,
    Constraint,
    ConstraintsConfig,
    ConstraintsTask,
    Problem,
    constraint_problems,
    constraints_of,
    contradiction,
    held_out_requests,
    words,
)
from redumix.data.shards import iter_rows, shard_paths
from redumix.data.splits import BUCKETS
from redumix.data.task import Example
from redumix.data.tasks import make_task, task_record
from redumix.pipeline.config import load_config
from redumix.pipeline.eval import run_eval
from redumix.pipeline.harvest import run_harvest
from redumix.pipeline.records import read_records, records_path
from redumix.pipeline.report import blind_replies, report_markdown, summarize
from redumix.pipeline.resolve import ConfigError
from redumix.pipeline.run import RunDir

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-135m-constraints.yaml"


def example(*constraints: Constraint) -> Example:
    problem = Problem("Describe your ideal weekend.", constraints)
    return Example("constraints-test-000000", "constraints", problem.text(), problem.reference())


# --- the checkers: a passing and a failing text each ----------------------------------------------------------------

# (kind, value, a text that obeys, a text that does not, what the verifier's sentence must say about it)
CASES = [
    ("lowercase", None, "a calm day by the lake. 42 ducks!", "Dear neighbour, I lost my cat.",
     '("Dear", "I"), but the instruction asks for all lowercase'),
    ("uppercase", None, "A CALM DAY BY THE LAKE, 42 DUCKS!", "A CALM day BY THE lake.",
     '("day", "lake"), but the instruction asks for all capital letters'),
    ("max_words", 5, "one two three four five -- *", "one two three four five six",
     "has 6 words, but the instruction asks for at most 5"),
    ("min_words", 3, "* one\n* two\n* three", "one - two",
     "has 2 words, but the instruction asks for at least 3"),
    ("include_words", ("blue", "river"), "The River was BLUE.", "The blueberry river.",
     'does not use the word "blue", but the instruction asks to include it'),
    ("include_words", ("blue", "river"), "A blue river.", "Nothing here.",
     'does not use the words "blue" and "river", but the instruction asks to include them'),
    ("avoid_words", ("very", "the"), "There is nothing every other day.", "The day was very nice.",
     'uses the words "very" and "the", but the instruction asks to avoid them'),
    ("avoid_letter", "z", "A quiet day.", "A lazy day at the Zoo.",
     'contains the letter "z" (in "lazy", "Zoo"), but the instruction asks to avoid it'),
    ("start_with", "Dear friend", "  dear FRIEND, how are you?", "Dear friendly neighbour, hi.",
     'starts with "Dear friendly", but the instruction asks it to start with "Dear friend"'),
    ("end_with", "That is all.", "Rest and read. that is all.  ", "That is all. Bye.",
     'ends with "is all. Bye.", but the instruction asks it to end with "That is all."'),
    ("end_with", "That is all.", "That is all.", "What is all.",
     'ends with "What is all.", but the instruction asks it to end with "That is all."'),
    ("bullets", 2, "My list:\n* sleep\n  - read\nDone - really.", "* sleep\n* read\n* walk\n*no space",
     'has 3 bullet points (lines starting with "* " or "- "), but the instruction asks for exactly 2'),
    ("no_commas", None, "Sleep and read.", "Sleep, read, walk.",
     "contains 2 commas, but the instruction asks for none"),
    ("json", None, '```json\n{"plan": ["sleep", "read"]}\n```', '{"plan": "sleep",}',
     "is not valid JSON (Expecting property name enclosed in double quotes at line 1, column 18)"),
    ("json", None, '[1, "two"]', '"just a string"',
     "is a bare JSON str, but the instruction asks for the whole answer wrapped in JSON"),
    ("title", None, "<<My Weekend>>\nSleep and read.", "<<  >> or <<broken\n>> or <My Weekend>",
     "has no title in double angular brackets, such as <<a quiet morning>>, but the instruction asks for one"),
]


@pytest.mark.parametrize("kind, value, good, bad, said", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_checker_passes_the_good_text_and_names_what_it_found_in_the_bad(kind, value, good, bad, said):
    constraint = Constraint(kind, value)
    assert constraint.failure(good) is None
    failure = constraint.failure(bad)
    assert failure is not None and said in failure, failure
    assert failure.startswith("The answer ") and failure.endswith(".")


def test_every_kind_has_a_case():
    assert {case[0] for case in CASES} == set(KINDS)


def test_a_word_is_a_whitespace_token_with_a_letter_or_digit():
    assert words("Don't stop -- * 42 ... x\n- y") == ["Don't", "stop", "42", "x", "y"]
    assert words("") == words(" * - ... ") == []


# --- prompts and splits ---------------------------------------------------------------------------------------------


def test_prompts_are_seeded_reproducible_and_extend_with_n():
    config = ConstraintsConfig()
    first = ConstraintsTask(config, seed=0).examples("test", 30)
    assert first == ConstraintsTask(config, seed=0).examples("test", 30)
    assert ConstraintsTask(config, seed=0).examples("test", 60)[:30] == first
    assert [e.prompt for e in ConstraintsTask(config, seed=1).examples("test", 30)] != [e.prompt for e in first]
    assert [e.id for e in first[:2]] == ["constraints-test-000000", "constraints-test-000001"]
    # The same text in any process and on any machine: seeds are strings, hashed with SHA-512 and SHA-256.
    assert first[0].prompt == "Explain how to stay calm before an exam. Wrap your entire answer in JSON format."
    assert json.loads(first[0].reference) == [{"kind": "json"}]
    suffixed = ConstraintsTask(config, seed=0, prompt_suffix="\nBe brief.").examples("test", 30)
    assert [e.prompt for e in suffixed] == [e.prompt + "\nBe brief." for e in first]


def test_train_and_test_split_by_a_stable_hash_of_the_canonical_problem():
    config = ConstraintsConfig()
    test = constraint_problems(config, "test", 300, seed=0)
    train = constraint_problems(config, "train", 900, seed=0)
    assert all(p.bucket == 0 for p in test) and all(1 <= p.bucket < BUCKETS for p in train)
    assert not {p.key for p in test} & {p.key for p in train}
    assert len({p.key for p in test}) == 300 and len({p.key for p in train}) == 900
    # The order of the constraints in the prompt does not change the problem, or its split.
    problem = train[next(i for i, p in enumerate(train) if len(p.constraints) > 1)]
    swapped = Problem(problem.topic, problem.constraints[::-1])
    assert swapped.key == problem.key and swapped.bucket == problem.bucket and swapped.text() != problem.text()


def test_by_default_the_prompts_are_those_drawn_before_holdout_requests_existed():
    """Pinned from the code before `holdout_requests`: 0 draws the same problems, bit for bit."""
    task = ConstraintsTask(ConstraintsConfig(), seed=0)
    digests = {"train": "9f89f8754efe527c95eab0ee361f8c12319076ac79a572b155a98a6594c72790",
               "test": "20bd4b531f282a5df2827d8e87872d05883031ecdbaf0caff36b28e0f1075ca3"}
    for split, digest in digests.items():
        found = [(e.id, e.prompt, e.reference) for e in task.examples(split, 300)]
        assert hashlib.sha256(json.dumps(found).encode()).hexdigest() == digest, split
    first = task.examples("train", 2)
    assert first[0].prompt == ("Explain why bicycles are good for cities. Answer in at least 24 words. Your entire "
                               "answer must be in lowercase letters, with no capital letters at all.")
    assert json.loads(first[1].reference) == [{"kind": "end_with", "value": "Is there anything else I can help with?"},
                                              {"kind": "title"}, {"kind": "no_commas"}]


def test_holdout_requests_keeps_whole_requests_for_the_test_split():
    config = ConstraintsConfig(holdout_requests=4)
    held = held_out_requests(4)
    assert len(held) == 4 and held <= set(TOPICS) and held_out_requests(4) == held < held_out_requests(5)
    train = constraint_problems(config, "train", 600, seed=0)
    test = constraint_problems(config, "test", 200, seed=0)
    assert not {p.topic for p in train} & {p.topic for p in test}
    assert {p.topic for p in test} == held and not {p.topic for p in train} & held
    assert not {p.key for p in train} & {p.key for p in test}
    assert {p.bucket for p in test} == set(range(BUCKETS))  # the request decides, not the bucket
    assert all(not contradiction(p.constraints) for p in train + test)


def test_holdout_requests_is_checked_by_key_and_joins_the_fingerprint_only_when_set():
    for value in (-1, len(TOPICS)):
        with pytest.raises(ConfigError) as info:
            load_config(RECIPE, [f"task.constraints.holdout_requests={value}"])
        assert "'task.constraints.holdout_requests'" in str(info.value) and "fewer than the 40 requests" in str(
            info.value)
    default, held = load_config(RECIPE), load_config(RECIPE, ["task.constraints.holdout_requests=3"])
    assert "holdout_requests" not in task_record(default.task)["settings"]  # old runs keep their fingerprints
    assert task_record(held.task)["settings"]["holdout_requests"] == 3


def test_the_settings_decide_the_kinds_and_their_numbers():
    config = ConstraintsConfig(constraints_min=2, constraints_max=2, kinds=["max_words", "bullets", "no_commas"],
                               max_words=[20, 25], bullets=[3, 3])
    problems = constraint_problems(config, "train", 200, seed=0)
    for problem in problems:
        by = {c.kind: c.value for c in problem.constraints}
        assert len(by) == 2 and set(by) <= {"max_words", "bullets", "no_commas"}
        assert 20 <= by.get("max_words", 20) <= 25 and by.get("bullets", 3) == 3
    counts = {len(p.constraints) for p in constraint_problems(ConstraintsConfig(), "train", 300, seed=0)}
    assert counts == {1, 2, 3}


def test_the_settings_are_checked_and_reported_by_key():
    with pytest.raises(ConfigError) as info:
        load_config(RECIPE, ["task.constraints.kinds=[lowercase, shouting]", "task.constraints.max_words=[30, 10]",
                             "task.constraints.constraints_max=4"])
    message = str(info.value)
    assert "task.constraints" in message and "unknown kinds ['shouting']" in message
    assert "max_words must be [low, high]" in message and "constraints_max" in message


def test_too_few_distinct_problems_is_an_error_not_a_hang():
    task = ConstraintsTask(ConstraintsConfig(constraints_max=1, kinds=["json"]), seed=0)
    assert len(task.examples("train", 30)) == 30  # 40 requests, about 36 of them in train
    with pytest.raises(ValueError, match="allow too few distinct problems"):
        task.examples("train", 40)


def test_only_the_named_task_joins_the_fingerprints():
    # A run of another task keeps its fingerprints whatever this task's settings, and the shipped base still matches
    # its recipe.
    arith = load_config(ROOT / "recipes" / "tiny.yaml")
    moved = load_config(ROOT / "recipes" / "tiny.yaml", ["task.constraints.constraints_max=2", "task.gsm8k.path=x"])
    assert task_record(arith.task) == task_record(moved.task)
    assert task_record(arith.task)["settings"] == {"steps_min": 2, "steps_max": 3, "start_max": 20, "operand_max": 20,
                                                   "factor_max": 9, "mul_value_max": 99}
    shipped = yaml.safe_load((ROOT / "models" / "tiny-base" / "build_config.yaml").read_text())
    assert task_record(arith.task) == shipped["task"]
    config = load_config(RECIPE)
    assert task_record(config.task)["settings"]["kinds"] == list(KINDS)
    assert isinstance(make_task(config.task, config.seed), ConstraintsTask)


# --- contradictions -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("constraints", [
    [Constraint("lowercase"), Constraint("uppercase")],
    [Constraint("include_words", ("blue",)), Constraint("avoid_letter", "b")],
    [Constraint("start_with", "Dear friend"), Constraint("avoid_letter", "f")],
    [Constraint("end_with", "That is all."), Constraint("avoid_words", ("very", "all"))],
    [Constraint("max_words", 20), Constraint("min_words", 21)],
    [Constraint("json"), Constraint("bullets", 2)],
    [Constraint("json"), Constraint("end_with", "That is all.")],
    [Constraint("json"), Constraint("start_with", "Hello there")],
    [Constraint("max_words", 10), Constraint("start_with", "Here is my answer"),
     Constraint("end_with", "Is there anything else I can help with?")],
    [Constraint("max_words", 4), Constraint("bullets", 5)],
])
def test_contradictions_are_named(constraints):
    assert contradiction(constraints)


@pytest.mark.parametrize("constraints", [
    [Constraint("lowercase"), Constraint("start_with", "Dear friend")],  # case does not count in a phrase
    [Constraint("max_words", 20), Constraint("min_words", 20)],
    [Constraint("json"), Constraint("title"), Constraint("no_commas")],
    [Constraint("include_words", ("blue",)), Constraint("avoid_letter", "z"), Constraint("avoid_words", ("the",))],
    [Constraint("end_with", "Hello there"), Constraint("avoid_words", ("the",))],  # "there" is not "the"
])
def test_compatible_constraints_are_not_contradictions(constraints):
    assert contradiction(constraints) is None


def test_no_contradictory_pair_is_ever_drawn():
    problems = [*constraint_problems(ConstraintsConfig(), "train", 3000, seed=0),
                *constraint_problems(ConstraintsConfig(), "test", 1000, seed=3)]
    drawn = set()
    for problem in problems:
        by = {c.kind: c.value for c in problem.constraints}
        assert len(by) == len(problem.constraints)  # distinct kinds
        drawn |= set(by)
        assert not {"lowercase", "uppercase"} <= set(by)
        assert not ("json" in by and {"start_with", "end_with", "bullets"} & set(by))
        assert by.get("min_words", 0) <= by.get("max_words", 10**6)
        written = " ".join([*by.get("include_words", ()), by.get("start_with", ""), by.get("end_with", "")])
        assert by.get("avoid_letter", "#") not in written.lower()
        assert not set(by.get("avoid_words", ())) & set(written.lower().replace("?", " ").replace(".", " ").split())
        assert "max_words" not in by or len(words(written)) + by.get("bullets", 0) + ("title" in by) <= by["max_words"]
    assert drawn == set(KINDS)


# --- grading and feedback -------------------------------------------------------------------------------------------


THREE = example(Constraint("lowercase"), Constraint("max_words", 6), Constraint("include_words", ("blue",)))


def test_grading_is_strict_and_gives_each_kind_its_verdict():
    task = ConstraintsTask(ConstraintsConfig(), seed=0)
    assert task.is_correct("a blue sky all day.", THREE)
    assert task.sub_scores("a blue sky all day.", THREE) == {"lowercase": True, "max_words": True,
                                                             "include_words": True}
    assert not task.is_correct("A blue sky all day.", THREE)  # one capital letter of three constraints
    assert task.sub_scores("A blue sky all day.", THREE) == {"lowercase": False, "max_words": True,
                                                             "include_words": True}
    for empty in ("", "  \n", "* -- ..."):  # no word: nothing is met, though no capital letter was found
        assert not task.is_correct(empty, THREE) and not any(task.sub_scores(empty, THREE).values())
        assert task.feedback(empty, THREE) == "The answer has no words."
    assert task.answer("  a blue sky.\n") == "a blue sky." and task.answer(" \n") is None
    assert task.solutions("train", 3) == {}


def test_feedback_names_every_failed_constraint_and_only_those():
    task = ConstraintsTask(ConstraintsConfig(), seed=0)
    assert task.feedback("a blue sky all day.", THREE) == "All constraints are met."
    one = task.feedback("A blue sky all day.", THREE)
    assert one == ('The answer contains capital letters ("A"), but the instruction asks for all lowercase.')
    two = task.feedback("Dear friend I saw a red sky today.", THREE)
    assert two == ('The answer contains capital letters ("Dear", "I"), but the instruction asks for all lowercase. '
                   "The answer has 8 words, but the instruction asks for at most 6. "
                   'The answer does not use the word "blue", but the instruction asks to include it.')
    # Across many drawn prompts and texts: one sentence per failed constraint, each its checker's, in prompt order.
    texts = ["a blue sky.", "Dear friend, That is all.", "* one\n* two\n<<t>>", '{"a": "b"}', "HELLO THERE"]
    for e in task.examples("test", 100):
        for text in texts:
            failed = [c.failure(text) for c in [Constraint.from_spec(s) for s in json.loads(e.reference)]]
            said = task.feedback(text, e)
            assert said == (" ".join(f for f in failed if f) or "All constraints are met.")
            assert task.is_correct(text, e) == (said == "All constraints are met.")


def test_the_report_gives_the_pass_rate_per_kind():
    task = ConstraintsTask(ConstraintsConfig(), seed=0)
    other = example(Constraint("lowercase"), Constraint("no_commas"))
    outputs = [("a blue sky.", THREE), ("A blue sky.", THREE), ("a red sky.", THREE), ("a, b", other),
               ("a b", other)]
    records = [{"id": str(i), "correct": task.is_correct(text, e), "tokens": 3, "fpe": 5.0, "prefill_tokens": 2,
                "seconds": 0.1, "extra": {}, "sub_scores": task.sub_scores(text, e)}
               for i, (text, e) in enumerate(outputs)]
    row = summarize("base", "greedy", records)
    assert row["accuracy"] == 2 / 5
    assert row["sub_scores"] == {
        "include_words": {"passed": 2, "n": 3, "rate": 2 / 3},
        "lowercase": {"passed": 4, "n": 5, "rate": 4 / 5},
        "max_words": {"passed": 3, "n": 3, "rate": 1.0},
        "no_commas": {"passed": 1, "n": 2, "rate": 0.5},
    }
    markdown = report_markdown({"task": "constraints", "split": "test", "rows": [row], "diagnostics": {}})
    assert "| checkpoint | decoder | include_words | lowercase | max_words | no_commas |" in markdown
    assert "| base | greedy | 67% (3) | 80% (5) | 100% (3) | 50% (2) |" in markdown
    # A task without sub-scores (arith) gets neither the key nor the table.
    plain = summarize("base", "greedy", [{k: v for k, v in r.items() if k != "sub_scores"} for r in records])
    assert "sub_scores" not in plain
    assert "Pass rate per sub-score" not in report_markdown(
        {"task": "arith", "split": "test", "rows": [plain], "diagnostics": {}})


def template_reply(example: Example) -> str:
    return template_for({c.kind: c.value for c in constraints_of(example)})


def test_the_template_reply_reads_only_the_constraints_and_meets_every_kind_but_min_words():
    task = ConstraintsTask(ConstraintsConfig(), seed=0)
    examples = task.examples("test", 300)
    for e in examples:
        reply = template_reply(e)
        other = Example(e.id, e.task, "Describe a night sky full of stars." + e.prompt.split(".", 1)[1], e.reference)
        assert template_reply(other) == reply  # the request is never read
        assert task.is_correct(reply, e) == ("min_words" not in e.reference)
        assert len(words(reply)) <= 17  # the longest phrase, the longest opening and 5 bullets
    assert sorted(len(words(template_reply(e))) for e in examples)[150] <= 2
    assert template_reply(example(Constraint("uppercase"), Constraint("title"),
                                  Constraint("include_words", ("blue",)))) == "<<DONE>> BLUE"
    assert template_reply(example(Constraint("json"), Constraint("no_commas"))) == '["done"]'
    framed = example(Constraint("start_with", "Dear friend"), Constraint("bullets", 2),
                     Constraint("end_with", "That is all."))
    assert template_reply(framed) == "Dear friend\n* done\n* done\nThat is all."


def test_the_report_gives_the_blind_replies_as_baselines_for_constraints_only():
    task = ConstraintsTask(ConstraintsConfig(), seed=0)
    examples = task.examples("test", 300)
    rows = {r["reply"]: r for r in blind_replies(task, examples)}
    # Counted here without the checker: the template fails only min_words; "ok" (lowercase, one word, no comma)
    # passes when every constraint is one it cannot break.
    template = sum("min_words" not in e.reference for e in examples)
    harmless = {("lowercase", None), ("max_words", None), ("avoid_words", None), ("no_commas", None)}
    ok = sum(all((s["kind"], None) in harmless or (s["kind"] == "avoid_letter" and s["value"] not in "ok")
                 for s in json.loads(e.reference)) for e in examples)
    assert (rows["template reply (no topic)"]["passed"], rows["`ok` alone"]["passed"]) == (template, ok) == (254, 52)
    row = rows["template reply (no topic)"]
    assert row["n"] == 300 and row["accuracy"] == 254 / 300 and row["ci_low"] < 254 / 300 < row["ci_high"]
    markdown = report_markdown({"task": "constraints", "split": "test", "rows": [], "diagnostics": {},
                                "blind_replies": list(rows.values())})
    assert f"| template reply (no topic) | 84.7% | {row['ci_low']:.1%}–{row['ci_high']:.1%} | 254 / 300 |" in markdown
    # A task without blind replies (arith) gets no row and no table.
    arith = ArithTask(ArithConfig(), seed=0)
    assert blind_replies(arith, arith.examples("test", 20)) == []
    assert "answer no request" not in report_markdown(
        {"task": "arith", "split": "test", "rows": [], "diagnostics": {}, "blind_replies": []})


# --- the recipe on any chat model -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tiny_llama_chat_model):
    model, tokenizer = tiny_llama_chat_model
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_recipe_runs_unchanged_on_tiny_qwen2_and_llama(arch, tmp_path, tiny_model_dir, llama_dir):
    folder = tiny_model_dir if arch == "qwen2" else llama_dir
    # Only the model and the sizes are overridden: the task, its settings and the decoders are the recipe's.
    config = load_config(RECIPE, [
        f"model.path={folder}", "harvest.n=3", "harvest.batch_size=3", "harvest.shard_rows=3", "eval.n=3",
        "eval.n_other=2", "eval.batch_size=3", "sampling.max_new_tokens=8", "redumix.reflection_max_tokens=6",
        "redumix.critique_max_tokens=4",
    ])
    recipe = load_config(RECIPE)
    assert config.task == recipe.task and config.eval.decoders == recipe.eval.decoders
    task = make_task(config.task, config.seed)
    run = RunDir(tmp_path / "run")

    run_harvest(config, run)
    rows = list(iter_rows(shard_paths(run.harvest)))
    train = {e.id: e for e in task.examples("train", 3)}
    assert [r["id"] for r in rows] == list(train) and all(r["task"] == "constraints" for r in rows)
    for r in rows:  # graded (the reference holds the constraints) and told by the verifier
        assert r["original_correct"] == task.is_correct(r["original"], train[r["id"]])
        assert r["feedback"] == task.feedback(r["original"], train[r["id"]])

    run_eval(config, run)
    report = json.loads((run.eval / "report.json").read_text())
    assert report["task"] == "constraints"
    assert [(r["checkpoint"], r["decoder"]) for r in report["rows"]] == [("base", d) for d in recipe.eval.decoders]
    test = {e.id: e for e in task.examples("test", 3)}
    for row in report["rows"]:
        assert set(row["sub_scores"]) <= set(KINDS)
        records = read_records(records_path(run.eval / "generations", "base", row["decoder"]))
        assert len(records) == row["n"]
        for r in records:
            assert r["correct"] == task.is_correct(r["output"], test[r["id"]]) == all(r["sub_scores"].values())
        kinds = [c["kind"] for r in records for c in json.loads(r["reference"])]
        assert sum(s["n"] for s in row["sub_scores"].values()) == len(kinds)
    assert "Pass rate per sub-score" in (run.eval / "report.md").read_text()
    blind = {r["reply"]: r["passed"] for r in report["blind_replies"]}  # greedy's 3 examples, no model call
    assert blind == {"template reply (no topic)": sum(task.is_correct(template_reply(e), e) for e in test.values()),
                     "`ok` alone": sum(task.is_correct("ok", e) for e in test.values())}
