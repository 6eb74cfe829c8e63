"""`redumix ladder` on the embedded model: its arms decode what they say, its counts add up, and it resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from redumix.common.files import atomic_write_jsonl
from redumix.data.tasks import make_task
from redumix.pipeline.config import load_config
from redumix.pipeline.run import RunDir
from redumix.pipeline.studies.ladder import RESAMPLE, run_ladder, summarize_ladder
from redumix.pipeline.studies.ladder_report import ladder_table

MBPP = Path(__file__).resolve().parents[2] / "shared" / "data" / "mbpp" / "mbpp.jsonl"  # where task.code reads it
SMALL = ["ladder.n=6", "ladder.batch_size=6", "sampling.max_new_tokens=32", "redumix.reflection_max_tokens=16"]


def _records(folder, name: str = "records.jsonl") -> list[dict]:
    return [json.loads(line) for line in (folder / "ladder" / name).read_text().splitlines()]


def test_greedy_ladder_arms_and_counts(tmp_path):
    config = load_config("tiny", [*SMALL, "ladder.lams=[1.0,0.0]"])
    run_ladder(config, RunDir(tmp_path))
    records = _records(tmp_path)
    assert len(records) == 6
    for r in records:
        # A greedy resample is the attempt, and a redo at λ=1 decodes x alone: the attempt again.
        assert r["arms"][RESAMPLE]["text"] == r["attempt"]["text"]
        assert r["arms"]["verifier@1"]["text"] == r["attempt"]["text"]
        assert set(r["arms"]) == {RESAMPLE, "verifier@1", "verifier@0", "self@0.5"}
        assert r["feedback"] and "critique" in r
    summary = json.loads((tmp_path / "ladder" / "summary.json").read_text())
    right = sum(r["attempt"]["correct"] for r in records)
    assert summary["attempt_correct"] == right and summary["wrong_attempts"] == 6 - right
    for name, arm in summary["arms"].items():
        correct = sum(r["arms"][name]["correct"] for r in records)
        assert arm["accuracy"] == pytest.approx(correct / 6)
        assert correct == right + arm["fixed"] - arm["broken"]
    assert summary["arms"]["verifier@1"]["repeats"] == 1.0 and summary["arms"]["verifier@1"]["fixed"] == 0
    assert "| verifier@0 |" in (tmp_path / "ladder" / "ladder.md").read_text()
    examples = (tmp_path / "ladder" / "examples.md").read_text()
    repeat = summary["arms"]["verifier@0"]["examples"]["repeat_on_wrong"]
    assert "## verifier@0" in examples and "## self@0.5" in examples and "## resample" not in examples
    assert f"### a repeat of a wrong attempt: {repeat[0] if repeat else 'none'}" in examples
    # the committed grades (no reply text) give the same table
    grades = _records(tmp_path, "grades.jsonl")
    assert "text" in records[0]["attempt"] and all(len(g["attempt"]["text"]) == 16 for g in grades)
    again = json.loads(json.dumps(summarize_ladder(grades, list(summary["arms"]))))
    assert again == {k: v for k, v in summary.items() if k != "settings"}


def test_ladder_resumes_and_refuses_other_settings(tmp_path):
    config = load_config("tiny", SMALL)
    run_ladder(config, RunDir(tmp_path))
    whole = _records(tmp_path)
    atomic_write_jsonl(tmp_path / "ladder" / "records.jsonl", whole[:2])  # a run stopped after its first problems
    run_ladder(config, RunDir(tmp_path))
    again = {r["id"]: r for r in _records(tmp_path)}
    assert [again[r["id"]]["arms"] for r in whole] == [r["arms"] for r in whole]
    with pytest.raises(ValueError, match=r"redumix\.redo_temperature: 0\.0 -> 0\.7"):
        run_ladder(load_config("tiny", [*SMALL, "redumix.redo_temperature=0.7"]), RunDir(tmp_path))
    # A ladder's records come from one engine; on a new folder the embedded model is refused by vLLM, naming the key
    with pytest.raises(ValueError, match=r'[^.]engine: "hf" -> "vllm"'):
        run_ladder(load_config("tiny", [*SMALL, "engine=vllm"]), RunDir(tmp_path))
    with pytest.raises(ValueError, match=r"\bengine=vllm") as error:
        run_ladder(load_config("tiny", [*SMALL, "engine=vllm"]), RunDir(tmp_path / "new"))
    assert "make vllm" in str(error.value) or "head_dim 24" in str(error.value)
    assert not (tmp_path / "new" / "ladder").exists()  # refused before the folder is claimed


def test_a_finished_vllm_ladder_is_summarized_without_an_engine(tmp_path, monkeypatch):
    import redumix.pipeline.studies.ladder as ladder

    run_ladder(load_config("tiny", SMALL), RunDir(tmp_path))
    (tmp_path / "ladder" / "ladder.md").unlink()
    settings_path = tmp_path / "ladder" / "settings.json"  # the same records, as vLLM's engine writes them
    settings = json.loads(settings_path.read_text())
    settings["record"]["engine"] = "vllm"
    settings_path.write_text(json.dumps(settings))

    def no_engine(*args, **kwargs):
        raise AssertionError("a finished ladder folder built an engine")

    monkeypatch.setattr(ladder, "check_engine", no_engine)
    monkeypatch.setattr(ladder, "open_engine", no_engine)
    run_ladder(load_config("tiny", [*SMALL, "engine=vllm"]), RunDir(tmp_path))
    assert "| verifier@0 |" in (tmp_path / "ladder" / "ladder.md").read_text()
    with pytest.raises(AssertionError, match="built an engine"):  # one more problem is work: it needs the engine
        run_ladder(load_config("tiny", [*SMALL, "engine=vllm", "ladder.n=7"]), RunDir(tmp_path))


@pytest.mark.skipif(not MBPP.is_file(), reason=f"MBPP is read from {MBPP}, which is absent")
def test_reference_feedback_redoes_with_the_solution_in_x2(tmp_path, tiny_model_dir):
    config = load_config("tiny", [*SMALL, f"model.path={tiny_model_dir}", "task.name=code", "ladder.n=2",
                                  "ladder.feedback=reference", "ladder.self_critique=false", "ladder.lams=[0.0]"])
    run_ladder(config, RunDir(tmp_path))
    task_solutions = make_task(config.task, config.seed).solutions("train", 2)
    for r in _records(tmp_path):
        assert set(r["arms"]) == {RESAMPLE, "reference@0"}
        assert task_solutions[r["id"]].strip("`\npython") in r["feedback"]  # the privileged context, shown in x2
    settings = json.loads((tmp_path / "ladder" / "settings.json").read_text())["record"]
    assert settings["ladder"]["feedback"] == "reference"  # records of one kind of feedback are not resumed as another
    with pytest.raises(ValueError, match=r"ladder\.feedback: .*reference"):
        run_ladder(load_config("tiny", [*SMALL, f"model.path={tiny_model_dir}", "task.name=code", "ladder.n=2",
                                        "ladder.self_critique=false", "ladder.lams=[0.0]"]), RunDir(tmp_path))
    with pytest.raises(ValueError, match="self-critique arm is ladder.self_critique"):
        load_config("tiny", ["ladder.feedback=self"])


def test_sampled_resample_is_a_second_draw(tmp_path):
    config = load_config("tiny", [*SMALL, "redumix.redo_temperature=1.0", "ladder.self_critique=false"])
    run_ladder(config, RunDir(tmp_path))
    records = _records(tmp_path)
    assert set(records[0]["arms"]) == {RESAMPLE, "verifier@0.5", "verifier@0"}
    # At temperature 1 a 32-token answer of this model drawn twice is not the greedy attempt every time.
    assert any(r["arms"][RESAMPLE]["text"] != r["attempt"]["text"] for r in records)


def test_more_resamples_add_to_the_records_and_pair_at_equal_samples(tmp_path):
    sampled = [*SMALL, "redumix.redo_temperature=1.0", "ladder.self_critique=false", "ladder.lams=[0.0]"]
    run_ladder(load_config("tiny", sampled), RunDir(tmp_path / "one"))
    first = _records(tmp_path / "one")
    run_ladder(load_config("tiny", [*sampled, "ladder.resamples=3"]), RunDir(tmp_path / "one"))  # adds to the records
    added = _records(tmp_path / "one")
    run_ladder(load_config("tiny", [*sampled, "ladder.resamples=3"]), RunDir(tmp_path / "fresh"))
    fresh = _records(tmp_path / "fresh")
    assert [r["attempt"] for r in added] == [r["attempt"] for r in first]
    for before, after, whole in zip(first, added, fresh, strict=True):
        assert set(after["arms"]) == {RESAMPLE, "resample2", "resample3", "verifier@0"}
        assert {k: after["arms"][k] for k in before["arms"]} == before["arms"]  # nothing redone
        assert after["arms"] == whole["arms"]  # each resample has its own seeds: added later or not, the same draw
    assert any(r["arms"]["resample2"]["text"] != r["arms"][RESAMPLE]["text"] for r in added)
    summary = json.loads((tmp_path / "one" / "ladder" / "summary.json").read_text())
    wrong = [r for r in added if not r["attempt"]["correct"]]
    pair = summary["equal_samples"]["verifier@0+resample"]
    assert pair["fixed"] == sum(r["arms"]["verifier@0"]["correct"] or r["arms"][RESAMPLE]["correct"] for r in wrong)
    assert summary["best_of_resamples_fixed"][0] == summary["arms"][RESAMPLE]["fixed"]
    assert "| verifier@0+resample |" in (tmp_path / "one" / "ladder" / "ladder.md").read_text()
    with pytest.raises(ValueError, match="resamples=2 needs redumix.redo_temperature > 0"):
        load_config("tiny", [*SMALL, "ladder.resamples=2"])


def test_equal_samples_pairs_a_redo_and_a_resample_against_two_resamples():
    graded = lambda ok: {"text": "", "answer": None, "correct": ok, "tokens": 1}  # noqa: E731
    rows = [{"id": str(i), "attempt": graded(a), "arms": {RESAMPLE: graded(s1), "resample2": graded(s2),
                                                          "redo": graded(d)}}
            for i, (a, s1, s2, d) in enumerate([(False, False, False, True), (False, False, True, False),
                                                (False, True, False, False), (False, False, True, True),
                                                (False, False, False, False), (True, False, False, False)])]
    summary = summarize_ladder(rows, [RESAMPLE, "resample2", "redo"])
    pairs = summary["equal_samples"]
    assert pairs["resample+resample2"]["fixed"] == 3 and pairs["redo+resample"]["fixed"] == 3
    assert pairs["redo+resample"]["vs_two_resamples_table"] == {"both": 2, "fixed": 1, "broken": 1, "neither": 1}
    assert pairs["redo+resample"]["keep_right_accuracy"] == pytest.approx(4 / 6)
    assert summary["best_of_resamples_fixed"] == [1, 3]


def _row(i: int, attempt: bool, resample: bool, redo: bool, answers: tuple = ("1", "1", "2")) -> dict:
    graded = lambda ok, a: {"text": a, "answer": a, "correct": ok, "tokens": 3}  # noqa: E731
    return {"id": str(i), "attempt": graded(attempt, answers[0]),
            "arms": {RESAMPLE: graded(resample, answers[1]), "redo": graded(redo, answers[2])}}


def test_summary_pairs_the_redo_with_the_resample_on_wrong_attempts():
    rows = [_row(0, False, False, True), _row(1, False, True, True), _row(2, False, True, False),
            _row(3, False, False, False, ("5", "5", "5")), _row(4, True, True, False), _row(5, True, True, True)]
    summary = summarize_ladder(rows, [RESAMPLE, "redo"])
    redo = summary["arms"]["redo"]
    assert summary["wrong_attempts"] == 4
    assert (redo["fixed"], redo["broken"]) == (2, 1)
    assert redo["vs_resample_table"] == {"both": 1, "fixed": 1, "broken": 1, "neither": 1}
    assert redo["vs_resample_on_wrong"] == 0.0
    low, high = redo["vs_resample_interval"]
    assert low < 0 < high
    assert redo["repeats_on_wrong"] == 0.25 and redo["examples"]["repeat_on_wrong"] == ["3"]
    assert redo["keep_right_accuracy"] == pytest.approx(4 / 6)


def test_every_redo_instruction_the_config_accepts_has_its_text():
    import dataclasses
    import typing

    from redumix.data.prompts import REDO_INSTRUCTIONS, redo_messages
    from redumix.generate.redumix import RedumixConfig

    [field] = [f for f in dataclasses.fields(RedumixConfig) if f.name == "instruction"]
    hints = typing.get_type_hints(RedumixConfig)
    assert set(typing.get_args(hints["instruction"])) == set(REDO_INSTRUCTIONS)
    assert field.default in REDO_INSTRUCTIONS
    turn = redo_messages("Write a note.", "A note.", "Too long.", "Shorter.", REDO_INSTRUCTIONS["answer"])[-1]
    assert turn == {"role": "user", "content": REDO_INSTRUCTIONS["answer"]}


def test_a_reflection_that_writes_the_wrong_attempt_back_is_counted_with_what_the_redos_did_after_it():
    from redumix.pipeline.studies.ladder import ladder_table, quotes_attempt

    attempt = "def f(x):\n    # add one\n    return x + 2"
    assert quotes_attempt("Here's the corrected code:\n```python\ndef f(x):\n\n    return x + 2\n```", attempt)
    assert quotes_attempt("Fixed:\n```python\ndef f(x):\n    return x + 2\n    retu", attempt)  # cut by the cap
    assert not quotes_attempt("Fixed:\n```python\ndef f(x):\n    return x + 1\n```", attempt)
    assert not quotes_attempt("The function adds two instead of one.", attempt)
    assert not quotes_attempt("```python\ndef f(x):\n```", None)

    rows = [_row(0, False, False, True) | {"reflection_quotes_attempt": True},
            _row(1, False, True, False, ("1", "2", "1")) | {"reflection_quotes_attempt": True},
            _row(2, False, False, False) | {"reflection_quotes_attempt": False},
            _row(3, True, True, True) | {"reflection_quotes_attempt": True}]  # a right attempt is not counted
    summary = summarize_ladder(rows, [RESAMPLE, "redo"])
    assert summary["reflection_quotes_attempt"] == {"wrong_attempts": 2, "arms": {
        RESAMPLE: {"repeats": 1, "fixed": 1}, "redo": {"repeats": 1, "fixed": 1}}}
    assert "on 2 of 3 wrong attempts; on those: resample repeats 1, fixes 1; redo repeats 1, fixes 1." in \
        ladder_table(summary)
    assert "reflection_quotes_attempt" not in summarize_ladder([{k: v for k, v in r.items()
                                                                 if k != "reflection_quotes_attempt"} for r in rows],
                                                               [RESAMPLE, "redo"])


def test_committed_grades_stand_in_for_problems_a_lost_run_folder_measured(tmp_path):
    """A sitting's grades, committed, are read by the next sitting in a new run folder: its problems are not decoded
    again, and the table over all of them is the one a single run gives."""
    config = load_config("tiny", SMALL)
    run_ladder(config, RunDir(tmp_path / "whole"))
    whole = json.loads((tmp_path / "whole" / "ladder" / "summary.json").read_text())
    first = load_config("tiny", [*SMALL, "ladder.n=4"])
    run_ladder(first, RunDir(tmp_path / "first"))
    committed = tmp_path / "first" / "ladder"  # as copied to docs/records/ladder/NAME; the folder is then lost
    later = load_config("tiny", [*SMALL, f"ladder.records={committed}"])
    run_ladder(later, RunDir(tmp_path / "later"))
    assert len(_records(tmp_path / "later")) == 2  # only the two problems the first sitting did not measure
    summary = json.loads((tmp_path / "later" / "ladder" / "summary.json").read_text())
    assert summary == whole
    assert (tmp_path / "later" / "ladder" / "examples.md").is_file()
    with pytest.raises(ValueError, match=r"ladder\.records: .* other settings \(redumix\.redo_temperature"):
        run_ladder(load_config("tiny", [*SMALL, f"ladder.records={committed}", "redumix.redo_temperature=0.7"]),
                   RunDir(tmp_path / "other"))


def test_an_interrupted_ladder_leaves_grades_for_what_it_measured(tmp_path, monkeypatch):
    """grades.jsonl is written after each batch: a sitting stopped mid-run leaves the grades of its finished batches,
    which a new run folder reads back through `ladder.records` to give a single run's table."""
    import redumix.pipeline.studies.ladder as ladder

    config = load_config("tiny", [*SMALL, "ladder.n=4", "ladder.batch_size=2"])
    run_ladder(config, RunDir(tmp_path / "whole"))
    whole = json.loads((tmp_path / "whole" / "ladder" / "summary.json").read_text())
    batches, real_batch = [], ladder.ladder_batch

    def stopped_after_one(*args, **kwargs):
        batches.append(1)
        if len(batches) == 2:
            raise KeyboardInterrupt  # the sitting's time ran out during the second batch
        return real_batch(*args, **kwargs)

    monkeypatch.setattr(ladder, "ladder_batch", stopped_after_one)
    with pytest.raises(KeyboardInterrupt):
        run_ladder(config, RunDir(tmp_path / "stopped"))
    monkeypatch.undo()
    banked = tmp_path / "stopped" / "ladder"
    assert (banked / "ladder.md").read_text() == ladder_table(json.loads((banked / "summary.json").read_text()))
    assert [g["id"] for g in _records(tmp_path / "stopped", "grades.jsonl")] == [
        r["id"] for r in _records(tmp_path / "whole")[:2]]
    later = load_config("tiny", [*SMALL, "ladder.n=4", "ladder.batch_size=2", f"ladder.records={banked}"])
    run_ladder(later, RunDir(tmp_path / "later"))
    assert len(_records(tmp_path / "later")) == 2
    assert json.loads((tmp_path / "later" / "ladder" / "summary.json").read_text()) == whole
