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
from redumix.pipeline.run import RunDir
from redumix.pipeline.studies.rounds import round_dir, rounds_markdown, run_rounds

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
    assert "vs_previous" not in summary["rounds"][0]["greedy"] and "lost" not in summary["rounds"][0]
    for row in summary["rounds"][1:]:
        for decoder in ("greedy", "redumix-oracle"):  # paired with the same problems of the models before
            before, start = row[decoder]["vs_previous"], row[decoder]["vs_start"]
            assert before["fixed"] + before["broken"] <= row[decoder]["n"] and start is not None
        assert row["drift_kl"] >= 0 and row["train"]["steps"] == 2 and "heldout_kl" in row
        assert {"fixed", "broken"} <= set(row["harvest"])
    assert summary["rounds"][1]["greedy"]["vs_previous"] == summary["rounds"][1]["greedy"]["vs_start"]
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


def test_a_round_that_does_not_improve_or_loses_a_skill_says_so():
    def accuracy(value: float, change: dict | None = None) -> dict:
        return {"accuracy": value, "ci_low": value - 0.05, "ci_high": value + 0.05, "n": 300, "mean_tokens": 20.0,
                **({"vs_previous": change, "vs_start": change} if change else {})}

    flat = {"change": -0.02, "low": -0.05, "high": 0.01, "fixed": 10, "broken": 16}
    worse = {"change": -0.10, "low": -0.15, "high": -0.05, "fixed": 3, "broken": 33}
    row = {"round": 1, "greedy": accuracy(0.4, flat), "pdr": accuracy(0.5, worse), "improved": False, "lost": ["pdr"],
           "harvest": {"original_accuracy": 0.4, "redo_accuracy": 0.8, "fixed": 120, "broken": 4},
           "train": {"rows": {"train": 90, "skill": 100}, "steps": 12, "wall_seconds": 30.0},
           "heldout_kl": {"before": 0.1, "after": 0.05}, "drift_kl": 0.02}
    base = {"round": 0, "greedy": accuracy(0.42), "pdr": accuracy(0.6)}
    text = rounds_markdown({"decoders": ["greedy", "pdr"], "rounds": [base, row]})
    assert "**did not improve**" in text and "-2.0 [-5.0, +1.0] (10 / 16)" in text
    assert "-10.0 [-15.0, -5.0] (3 / 33) **lost**" in text
    details = "| 1 | 40.0% → 80.0% (120 / 4) | train 90, skill 100 | 12 | 30 | 0.1000 → 0.0500 | 0.0200 | 20.0 | pdr |"
    assert details in text


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
    write_base(run.embedded)
    write_harvest(run.harvest, n_rows=24, length=12)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\n")
    settings = [f"model.path={run.embedded}", "train.batch_size=4", "train.max_steps=2", "train.heldout_fraction=0.2",
                "train.skill_rows=true"]
    result = run_train(load_config(recipe, settings), run)
    train_rows, _ = split_heldout(filter_rows(load_harvest(run.harvest), "all"), 0.2)
    right = sum(r is True for r in train_rows["redo_correct"])
    assert right > 0 and result["rows"]["skill"] == 2 * right


def test_replay_teaches_the_base_corpus_improvement_turns_with_check_spans_as_context(tiny_tokenizer):
    from redumix.embedded import CONTEXT_ONLY, replay_conversations
    from redumix.embedded.vocab import REFLECT_OPEN
    from redumix.train.data import SparseTeacherCollator, conversation_examples, end_of_turn_ids

    config = load_config(ROOT / "recipes" / "tiny.yaml", ["train.replay=0.3"])
    conversations = replay_conversations(config.task, config.embedded.corpus, config.seed, 300)
    # seeded: the same episodes on every rank and rerun
    assert conversations == replay_conversations(config.task, config.embedded.corpus, config.seed, 300)
    kinds = [c[0].rsplit("-", 1)[1] for c in conversations]
    assert set(kinds) == {"reflection", "critique", "refine", "solution"}
    assert all(REFLECT_OPEN in m[-1]["content"] for k, (_, m, _) in zip(kinds, conversations, strict=True)
               if k == "solution")  # plain solutions are the harvest's to teach
    assert sum(len(trained) for _, _, trained in conversations) >= 300

    reflect = tiny_tokenizer.convert_tokens_to_ids(REFLECT_OPEN)
    examples = conversation_examples(conversations, tiny_tokenizer, 1024, frozenset([reflect]))
    assert len(examples) == sum(len(trained) for _, _, trained in conversations)
    end = end_of_turn_ids(tiny_tokenizer)
    first_id, messages, trained = conversations[0]
    first = examples[0]
    assert first["id"] == f"{first_id}/turn-{trained[0]}"
    target = first["input_ids"][first["prompt_length"]:]
    assert tiny_tokenizer.decode(target[: -len(end)]) == messages[trained[0]]["content"] and target[-len(end):] == end
    spans = [e for e in examples if reflect in e["input_ids"][e["prompt_length"]:]]
    assert spans and CONTEXT_ONLY == (REFLECT_OPEN,)
    for e in spans:  # the span opener is context; every other target token is its own one-hot teacher
        for token, step in zip(e["input_ids"][e["prompt_length"]:], e["teacher_ids"], strict=True):
            assert step == ([] if token == reflect else [token])
    batch = SparseTeacherCollator(tiny_tokenizer.pad_token_id)([spans[0], examples[0]])
    assert reflect not in batch["labels"]
    assert int((batch["labels"][:, 1:] != -100).sum()) == int(batch["teacher_mask"].sum())

    with pytest.raises(ConfigError, match="replay"):
        load_config(ROOT / "recipes" / "tiny.yaml", ["train.replay=1.0"])
    gsm8k = load_config(ROOT / "recipes" / "tiny.yaml", ["train.replay=0.3", "task.name=gsm8k"])
    with pytest.raises(ValueError, match="task.name is 'gsm8k'; set train.replay=0"):
        replay_conversations(gsm8k.task, gsm8k.embedded.corpus, gsm8k.seed, 10)


def test_training_with_replay_adds_the_share_of_corpus_examples(tmp_path):
    from redumix.pipeline.train import run_train
    from tests.train_fixtures import write_base, write_harvest

    run = RunDir(tmp_path / "run")
    write_base(run.embedded)
    write_harvest(run.harvest, n_rows=24, length=12)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\n")
    settings = [f"model.path={run.embedded}", "train.batch_size=4", "train.max_steps=2", "train.heldout_fraction=0.2",
                "train.replay=0.25"]
    rows = run_train(load_config(recipe, settings), run)["rows"]
    assert rows["replay"] >= round(rows["train"] / 3)  # a quarter of the whole: a third of the harvest's examples
