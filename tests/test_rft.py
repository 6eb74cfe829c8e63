"""The `rft` evidence arm's k samples a problem (pipeline/studies/rft.py) on the embedded model: they are the ladder's
resamples, the rows are each problem's distinct right answers, the folder trains, and a stopped run resumes."""

from __future__ import annotations

import json

import pytest

from redumix.common.files import atomic_write_jsonl
from redumix.data.tasks import make_task
from redumix.pipeline.config import load_config
from redumix.pipeline.evidence_arms import ARMS
from redumix.pipeline.harvest_folder import check_harvest
from redumix.pipeline.run import RunDir
from redumix.pipeline.studies.evidence import harvest_for
from redumix.pipeline.studies.ladder import run_ladder
from redumix.pipeline.studies.rft import draw_samples
from redumix.train.data import filter_rows, load_harvest

SMALL = ["harvest.n=6", "harvest.shard_rows=4", "harvest.batch_size=3", "sampling.max_new_tokens=32",
         "redumix.reflection_max_tokens=16", "redumix.redo_temperature=1.0"]


def _samples(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]


def test_rft_rows_are_each_problems_distinct_right_answers_drawn_as_the_ladder_draws(tmp_path):
    config = load_config("tiny", [*SMALL, "evidence.rft_samples=3"])
    run = RunDir(tmp_path / "run")
    out = harvest_for(config, run, ARMS["rft"].harvest)
    folder = run.root / "evidence" / "harvest-rft"
    assert out == folder / "harvest"
    check_harvest(out)  # a complete folder that train accepts

    samples = {r["id"]: r["samples"] for r in _samples(folder)}
    harvest = {r["id"]: r for r in load_harvest(run.harvest)}
    assert set(samples) == set(harvest) and all(set(s) == {"resample", "resample2", "resample3"}
                                                 for s in samples.values())
    # The same texts as the ladder's resamples of those problems, with the same seeds and policy.
    ladder = load_config("tiny", [*SMALL, "ladder.n=6", "ladder.batch_size=6", "ladder.resamples=3",
                                  "ladder.lams=[0.0]", "ladder.self_critique=false"])
    run_ladder(ladder, RunDir(tmp_path / "ladder"))
    lines = (tmp_path / "ladder" / "ladder" / "records.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    for r in records:
        assert {name: r["arms"][name]["text"] for name in samples[r["id"]]} == \
               {name: s["text"] for name, s in samples[r["id"]].items()}
    assert any(s["resample"]["text"] != s["resample2"]["text"] for s in samples.values())

    # Each problem's rows: its right attempt, then its right samples, each distinct text once, graded again here.
    task = make_task(config.task, config.seed)
    examples = {e.id: e for e in task.examples("train", 6)}
    rows = load_harvest(out)
    assert all(rows["original_correct"])
    for id_, row in harvest.items():
        texts = [row["original"]] if row["original_correct"] else []
        texts += [s["text"] for s in samples[id_].values() if s["correct"]]
        kept = [r["original"] for r in rows if r["id"] == id_]
        assert kept == list(dict.fromkeys(texts))
        assert all(task.is_correct(text, examples[id_]) for text in kept)
        assert all(r["redo"] == row["redo"] and r["prompt"] == row["prompt"] for r in rows if r["id"] == id_)
    assert len(rows) > sum(r["original_correct"] for r in harvest.values())  # samples add right answers
    assert len(filter_rows(rows, ARMS["rft"].train["rows"])) == len(rows)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["rows"] == len(rows) and manifest["rft_samples"] == 3 and manifest["problems"] == 6

    # A run stopped after two problems' samples goes on from there, and gives the same rows.
    atomic_write_jsonl(folder / "samples.jsonl", _samples(folder)[:2])
    (out / "manifest.json").unlink()
    assert harvest_for(config, run, "rft") == out
    assert {r["id"]: r["samples"] for r in _samples(folder)} == samples
    assert load_harvest(out)["original"] == rows["original"]


def test_without_samples_the_arm_learns_the_harvest_and_samples_need_a_sampled_redo(tmp_path):
    config = load_config("tiny", [*SMALL, "harvest.n=3"])
    run = RunDir(tmp_path)
    assert config.evidence.rft_samples == 0 and harvest_for(config, run, "rft") == run.harvest
    assert not (run.root / "evidence" / "harvest-rft").exists()
    with pytest.raises(ValueError, match=r"rft_samples=2 samples at the redo's temperature.*rft_temperature"):
        load_config("tiny", ["evidence.rft_samples=2"])
    with pytest.raises(ValueError, match="rft_temperature must be > 0 or null"):
        load_config("tiny", ["evidence.rft_samples=2", "evidence.rft_temperature=0"])


def test_rft_temperature_samples_a_greedy_recipe(tmp_path):
    """A recipe whose redo is greedy samples its RFT answers at evidence.rft_temperature; its harvest is untouched."""
    from redumix.generate.redumix import redo_policy
    from redumix.pipeline.run import model_path

    config = load_config("tiny", [*SMALL[:-1], "evidence.rft_samples=2", "evidence.rft_temperature=1.0"])
    assert redo_policy(config.redumix, config.sampling).greedy
    run = RunDir(tmp_path)
    out = harvest_for(config, run, "verifier")
    rows = list(load_harvest(out))
    samples = draw_samples(config, model_path(config.model.path, run), rows, tmp_path / "rft")
    texts = [[s[name]["text"] for name in ("resample", "resample2")] for s in samples.values()]
    assert any(a != b for a, b in texts)
    assert any(row["original"] not in pair for row, pair in zip(rows, texts, strict=True))
    with pytest.raises(ValueError, match="rft_samples must be >= 0"):
        load_config("tiny", [*SMALL, "evidence.rft_samples=-1"])


def test_a_problem_harvested_several_times_gives_its_distinct_right_answers_once():
    """With `harvest.attempts` > 1 a problem has several rows: its right attempts and right samples become one row
    per distinct text, not one set per row."""
    from redumix.pipeline.studies.rft import kept_rows

    rows = [{"id": "a", "original": "x", "original_correct": False, "redo": "r1"},
            {"id": "a", "original": "y", "original_correct": True, "redo": "r2"},
            {"id": "a", "original": "z", "original_correct": True, "redo": "r3"},
            {"id": "b", "original": "w", "original_correct": False, "redo": "r4"}]
    samples = {"a": {"resample": {"text": "y", "correct": True}, "resample2": {"text": "v", "correct": True}},
               "b": {"resample": {"text": "u", "correct": False}, "resample2": {"text": "t", "correct": True}}}
    kept = kept_rows(rows, samples, ["resample", "resample2"])
    assert [(r["id"], r["original"]) for r in kept] == [("a", "y"), ("a", "z"), ("a", "v"), ("b", "t")]
    assert all(r["original_correct"] and r["redo"] == ("r1" if r["id"] == "a" else "r4") for r in kept)
