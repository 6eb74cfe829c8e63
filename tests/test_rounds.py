"""`redumix rounds` on a tiny random model: each round starts from the last one's tuned model, harvests problems no
earlier round saw, resumes, and reports every round."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from redumix.data.shards import iter_rows, shard_paths
from redumix.pipeline.config import load_config
from redumix.pipeline.resolve import ConfigError
from redumix.pipeline.rounds import round_dir, rounds_markdown, run_rounds
from redumix.pipeline.run import RunDir

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "harvest.n=6", "harvest.shard_rows=3", "harvest.batch_size=3", "sampling.max_new_tokens=6",
    "sampling.temperature=1.0", "redumix.reflection_max_tokens=5", "redumix.critique_max_tokens=4", "redumix.topk=8",
    "train.adapter=full", "train.max_steps=2", "train.batch_size=2", "train.heldout_fraction=0.34",
    "train.save_steps=1", "train.logging_steps=1", "eval.n=4", "eval.n_other=3", "eval.batch_size=2",
    "rounds.count=2",
]


def _ids(run: RunDir) -> list[str]:
    return [row["id"] for row in iter_rows(shard_paths(run.harvest))]


def test_rounds_chain_models_use_disjoint_problems_resume_and_report(tmp_path, tiny_model_dir, capsys):
    config = load_config(ROOT / "recipes" / "tiny.yaml", [f"model.path={tiny_model_dir}", *SMALL])
    run = RunDir(tmp_path / "run")
    summary = run_rounds(config, run)

    first, second = round_dir(run, 1), round_dir(run, 2)
    assert len(_ids(first)) == len(_ids(second)) == 6 and not set(_ids(first)) & set(_ids(second))
    starts = [yaml.safe_load(r.config.read_text())["model"]["path"] for r in (first, second)]
    assert starts == [str(Path(tiny_model_dir).resolve()), str((first.train / "merged").resolve())]
    report = json.loads((second.eval / "report.json").read_text())
    assert report["checkpoints"] == {"tuned": str(second.train / "merged")}  # round 1's tuned model is not redone

    assert [row["round"] for row in summary["rounds"]] == [0, 1, 2]
    for row in summary["rounds"]:
        assert row["greedy"]["n"] == 4 and row["redumix-oracle"]["n"] == 3
    assert "greedy_vs_previous" not in summary["rounds"][0]
    assert all("greedy_vs_previous" in row and "heldout_kl" in row for row in summary["rounds"][1:])
    assert [row["harvest"]["skip"] for row in summary["rounds"][1:]] == [0, 6]
    folder = run.root / "rounds"
    assert (folder / "rounds.png").stat().st_size > 0
    assert (folder / "rounds.md").read_text() == rounds_markdown(summary)
    assert json.loads((folder / "rounds.json").read_text()) == summary

    # A rerun redoes nothing: every stage of every round is complete.
    stamps = {p: p.stat().st_mtime_ns for p in run.root.rglob("*.safetensors")}
    capsys.readouterr()
    assert run_rounds(config, run) == summary
    out = capsys.readouterr().out
    assert out.count("harvest: complete") == 2 and out.count("train: already complete") == 2
    assert {p: p.stat().st_mtime_ns for p in run.root.rglob("*.safetensors")} == stamps


def test_a_round_that_does_not_improve_says_so():
    row = {"round": 1, "greedy": {"accuracy": 0.4, "ci_low": 0.35, "ci_high": 0.45, "n": 300, "mean_tokens": 20.0},
           "greedy_vs_previous": {"change": -0.02, "low": -0.05, "high": 0.01, "fixed": 10, "broken": 16},
           "improved": False}
    base = {"round": 0, "greedy": {"accuracy": 0.42, "ci_low": 0.37, "ci_high": 0.47, "n": 300, "mean_tokens": 20.0}}
    text = rounds_markdown({"decoders": ["greedy"], "rounds": [base, row]})
    assert "**did not improve**" in text and "-2.0 pts [-5.0, +1.0]" in text


def test_bad_rounds_settings_name_the_key():
    with pytest.raises(ConfigError, match="rounds"):
        load_config(ROOT / "recipes" / "tiny.yaml", ["rounds.count=0"])


def test_a_round_policy_can_accumulate_rows_and_anchor_the_trainee_and_the_harvester(tmp_path, tiny_model_dir):
    from redumix.pipeline.lineage import harvest_id, model_id

    config = load_config(ROOT / "recipes" / "tiny.yaml", [f"model.path={tiny_model_dir}", *SMALL,
                                                          "rounds.accumulate=true", "rounds.restart=start",
                                                          "rounds.harvester=start"])
    run = RunDir(tmp_path / "run")
    run_rounds(config, run)
    first, second = round_dir(run, 1), round_dir(run, 2)
    trained = json.loads((second.train / "metrics.json").read_text())
    assert trained["rows"]["harvested"] == 12  # its own 6 rows and round 1's
    assert trained["inputs"]["more_harvests"] == [harvest_id(first.harvest)]
    assert trained["inputs"]["base"] == model_id(tiny_model_dir)  # restarted from the starting model
    models = {json.loads(row["meta"])["model"] for row in iter_rows(shard_paths(second.harvest))}
    assert models == {str(Path(tiny_model_dir).resolve())}  # harvested by the starting model, not round 1's


def test_skill_rows_teach_the_reflection_turn_and_the_in_context_redo_of_right_redos(tiny_tokenizer):
    from datasets import Dataset

    from redumix.data.chat import prompt_ids
    from redumix.data.prompts import reflect_messages
    from redumix.train.data import end_of_turn_ids, skill_examples

    def row(i: int, right: bool) -> dict:
        return {"id": f"r{i}", "prompt": f"What is {i} + 1?", "original": f"{i} + 1 = 9", "feedback": "Wrong.",
                "reflection": f"Check: {i} + 1 = {i + 1}.", "redo": f"{i} + 1 = {i + 1}", "redo_correct": right,
                "x2_token_ids": [5, 6, 7, i]}

    rows = Dataset.from_list([row(1, True), row(2, False), row(3, True)])
    examples = skill_examples(rows, tiny_tokenizer, max_length=512)
    assert examples["id"] == ["r1/reflect", "r1/redo-in-context", "r3/reflect", "r3/redo-in-context"]
    end = end_of_turn_ids(tiny_tokenizer)
    reflect, redo = examples[0], examples[1]
    context = prompt_ids(tiny_tokenizer, reflect_messages("What is 1 + 1?", "1 + 1 = 9", "Wrong."))
    assert reflect["input_ids"][: reflect["prompt_length"]] == context
    assert tiny_tokenizer.decode(reflect["input_ids"][reflect["prompt_length"]:-len(end)]) == "Check: 1 + 1 = 2."
    assert redo["input_ids"][: redo["prompt_length"]] == [5, 6, 7, 1]  # x2 exactly as the harvest cached it
    assert tiny_tokenizer.decode(redo["input_ids"][redo["prompt_length"]:-len(end)]) == "1 + 1 = 2"
    assert [t for [t] in redo["teacher_ids"]] == redo["input_ids"][redo["prompt_length"]:]  # one-hot on its text


def test_training_with_skill_rows_adds_two_examples_per_right_redo(tmp_path):
    from redumix.pipeline.train import run_train
    from redumix.train.data import filter_rows, load_harvest, split_heldout
    from tests.train_fixtures import write_base, write_harvest

    run = RunDir(tmp_path / "run")
    write_base(run.base)
    write_harvest(run.harvest, n_rows=24, length=12)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\n")
    settings = [f"model.path={run.base}", "train.batch_size=4", "train.max_steps=2", "train.heldout_fraction=0.2",
                "train.skill_rows=true"]
    result = run_train(load_config(recipe, settings), run)
    train_rows, _ = split_heldout(filter_rows(load_harvest(run.harvest), "all"), 0.2)
    right = sum(r is True for r in train_rows["redo_correct"])
    assert right > 0 and result["rows"]["skill"] == 2 * right
