"""`redumix evidence` on a tiny random model: every arm trains the same steps from its own harvest, is measured on
the test split, the held-out variant and its drift, and the summary's paired tests are what the records say."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from redumix.common.files import atomic_write_json
from redumix.data.tasks import make_task
from redumix.pipeline.cli import main
from redumix.pipeline.config import load_config
from redumix.pipeline.records import read_records, records_path
from redumix.pipeline.resolve import ConfigError
from redumix.pipeline.run import RunDir, arm_dir
from redumix.pipeline.studies.evidence import (
    forgetting_tasks,
    recorded_arm,
    run_evidence,
    saved_answers,
    write_summary,
)
from redumix.pipeline.studies.evidence_report import evidence_markdown, paired_arms
from tests.test_rounds import SMALL

ROOT = Path(__file__).resolve().parents[1]
ARMS = ["evidence.main_arms=[mixture, gold, redo]", "evidence.other_arms=[lambda0, feedback-none, on-policy]",
        "evidence.seeds=[0, 1]", "evidence.n=4", "evidence.drift_n=3", "train.onpolicy_max_new_tokens=4"]
# Forgetting measured on another recipe's task: here arith with four steps where the recipe has two or three.
LONGER = "'tiny task.arith.steps_min=4 task.arith.steps_max=4 eval.n=3 sampling.max_new_tokens=5'"


def test_every_arm_trains_the_same_steps_is_measured_and_summarised(tmp_path, tiny_model_dir, capsys):
    general = tmp_path / "general.jsonl"
    general.write_text("".join(json.dumps({"question": f"What is {i} plus {i}?", "answer": f"{i} + {i} = {2 * i}"})
                               + "\n" for i in range(5)))
    config = load_config(ROOT / "recipes" / "tiny.yaml", [f"model.path={tiny_model_dir}", *SMALL, *ARMS,
                                                          f"evidence.general_path={general}",
                                                          f"evidence.forgetting=[{LONGER}]"])
    run = RunDir(tmp_path / "run")
    summary = run_evidence(config, run)
    folder = run.root / "evidence"

    assert set(summary["arms"]) == {"mixture", "gold", "redo", "lambda0", "feedback-none", "on-policy"}
    assert summary["arms"]["mixture"]["seeds"] == [0, 1] and summary["arms"]["on-policy"]["seeds"] == [0]
    assert {a["steps"] for a in summary["arms"].values()} == {2}
    for arm, seed in [("gold", 1), ("lambda0", 0), ("on-policy", 0)]:
        settings = yaml.safe_load(arm_dir(folder, arm, seed).config.read_text())
        assert settings["train"]["seed"] == seed
    lam0 = yaml.safe_load((folder / "harvest-lambda0" / "config.yaml").read_text())
    assert lam0["redumix"]["lam"] == 0.0
    assert yaml.safe_load((folder / "harvest-none" / "config.yaml").read_text())["redumix"]["feedback"] == "none"
    gold = yaml.safe_load(arm_dir(folder, "gold", 0).config.read_text())["train"]
    assert gold["target"] == "gold" and gold["rows"] == "all" and gold["harvest_dir"] == str(run.harvest)
    # The variant is another task: numbers up to 30 where the recipe has 20.
    variant = read_records(records_path(arm_dir(folder, "redo", 0).root / "variant" / "eval" / "generations", "base",
                                        "greedy"))
    numbers = [int(n) for r in variant for n in re.findall(r"\d+", r["prompt"])]
    assert len(variant) == 4 and max(numbers) > 20
    for arm in summary["arms"].values():
        assert arm["drift_kl"]["min"] >= 0 and arm["offtask_kl"]["min"] >= 0 and arm["text_nll"]["min"] > 0
    # Off the task, every arm is measured on the base's own answers to the first drift_n questions.
    answers = json.loads((folder / "base" / "general_answers.json").read_text())
    assert len(answers["questions"]) == len(answers["answer_ids"]) == 3
    assert summary["general"]["prompts"] == summary["general"]["texts"] == 3
    # The base's loss on the texts is measured once, by the first arm, and read by the others.
    base_nll = json.loads((folder / "base" / "text_nll.json").read_text())
    assert len(base_nll["texts"]) == 3 and base_nll["text_nll"] == summary["general"]["base_text_nll"]
    drifts = [json.loads((arm_dir(folder, a, s).root / "drift.json").read_text()) for a, s in
              [("mixture", 0), ("redo", 1), ("on-policy", 0)]]
    assert {d["text_nll_base"] for d in drifts} == {base_nll["text_nll"]}
    # Each arm's drift is measured with its accuracy, while its weights are here, before the next arm trains.
    assert (arm_dir(folder, "mixture", 0).root / "drift.json").stat().st_mtime_ns < (
        arm_dir(folder, "mixture", 1).train / "metrics.json").stat().st_mtime_ns
    # Forgetting: every arm and the base greedy on the other recipe's task, its n, its prompts, its answer length.
    other = forgetting_tasks(config)["arith"]
    longer = [(e.id, e.prompt) for e in make_task(other.task, other.seed).examples("test", 3)]
    test_prompts = {r["prompt"] for r in read_records(records_path(folder / "base" / "eval" / "generations", "base",
                                                                    "greedy"))}
    assert len(test_prompts) == 4 and not test_prompts & {p for _, p in longer}
    assert summary["parts"] == ["test", "variant", "arith"] and summary["base"]["arith"]["n"] == 3
    for arm, seed in [("base", None), ("mixture", 1), ("on-policy", 0)]:
        here = RunDir(folder / "base") if seed is None else arm_dir(folder, arm, seed)
        records = read_records(records_path(here.root / "forgetting" / "arith" / "eval" / "generations", "base",
                                            "greedy"))
        assert [(r["id"], r["prompt"]) for r in records] == longer and all(r["tokens"] <= 5 for r in records)
        correct = {r["id"]: bool(r["correct"]) for r in records}
        if seed is not None:
            assert summary["arms"][arm]["arith"]["values"][summary["arms"][arm]["seeds"].index(seed)] == (
                sum(correct.values()) / 3)
    assert summary["vs_base"]["mixture"]["arith"]["problems"] == 3
    assert "| arith accuracy | vs base (arith) |" in evidence_markdown(summary)
    assert "KL(tuned ‖ base), off task" in evidence_markdown(summary)
    assert (folder / "evidence.md").read_text() == evidence_markdown(summary)
    assert (folder / "evidence.png").stat().st_size > 0

    # A rerun trains and decodes nothing again.
    stamps = {p: p.stat().st_mtime_ns for p in folder.rglob("*.safetensors")}
    capsys.readouterr()
    assert run_evidence(config, run) == summary
    assert "train: already complete" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in folder.rglob("*.safetensors")} == stamps
    assert summary["complete"] and summary["planned"] == 9

    # The study outlives its run folder: `redumix grades` keeps each model's grades, train summary and settings and
    # drift, and a new run folder with `evidence.records` reads every arm-seed back, training and decoding nothing.
    records = tmp_path / "records"
    assert main(["grades", str(folder), str(records)]) == 0
    assert not list(records.rglob("*.safetensors")) and (records / "base" / "general_answers.json").is_file()
    from_records = load_config(ROOT / "recipes" / "tiny.yaml", [
        f"model.path={tiny_model_dir}", *SMALL, *ARMS, f"evidence.general_path={general}",
        f"evidence.forgetting=[{LONGER}]", f"evidence.records={records}"])
    fresh = RunDir(tmp_path / "fresh")
    capsys.readouterr()
    assert run_evidence(from_records, fresh) == summary
    assert "evidence: arm on-policy, seed 0 read from the records" in capsys.readouterr().out
    assert not (fresh.root / "harvest").exists() and not list(fresh.root.rglob("train"))
    # An arm-seed recorded with other train settings is not read back: it is trained again, and the log says why.
    other_lr = dataclasses.replace(from_records, train=dataclasses.replace(from_records.train, learning_rate=1e-3))
    assert not recorded_arm(other_lr, records, fresh.evidence, arm_dir(fresh.evidence, "gold", 1), tiny_model_dir,
                            "gold", 1, 2, forgetting_tasks(other_lr))
    assert "train.learning_rate" in capsys.readouterr().out
    # Records of a base without its answers to the general questions (committed before grades kept them): a new
    # folder decodes them, and an arm-seed measured there gets its drift off the task too.
    for name in ("general_answers.json", "text_nll.json"):
        (records / "base" / name).unlink()
    shutil.rmtree(records / "gold" / "seed-1")
    again = RunDir(tmp_path / "again")
    run_evidence(from_records, again)
    assert (again.evidence / "base" / "general_answers.json").is_file()
    assert {"kl_tuned_base", "kl_offtask", "text_nll", "text_nll_base"} <= json.loads(
        (arm_dir(again.evidence, "gold", 1).root / "drift.json").read_text()).keys()
    # and `redumix grades` keeps them, though the base has no eval in that folder.
    assert main(["grades", str(again.evidence), str(tmp_path / "records-again")]) == 0
    assert (tmp_path / "records-again" / "base" / "general_answers.json").is_file()

    # A sitting stopped after three arms (the mixture's two seeds and gold's first) left a table of those three,
    # their drift not measured.
    for drift in folder.glob("*/seed-*/drift.json"):
        drift.unlink()
    plan = [(arm, seed) for arm in ["mixture", "gold", "redo"] for seed in [0, 1]]
    plan += [("lambda0", 0), ("feedback-none", 0), ("on-policy", 0)]
    so_far = write_summary(config, folder, plan, 3, ["arith"])
    assert not so_far["complete"] and so_far["arms"]["mixture"]["seeds"] == [0, 1] and list(so_far["arms"]) == [
        "mixture", "gold"]
    assert so_far["arms"]["gold"]["test"]["values"] == summary["arms"]["gold"]["test"]["values"][:1]
    table = (folder / "evidence.md").read_text()
    assert table.startswith("# Evidence so far: 3 of 9 arm-seeds measured")
    assert table.count("| not measured |") == 2  # the drift cells of mixture and gold


@pytest.mark.slow  # three evidence studies on the tiny model: minutes
def test_arms_run_alone_train_the_steps_the_study_already_trained(tmp_path, tiny_model_dir, capsys):
    # A recipe that sets no train.max_steps (epochs): the first arm-seed to train sets the study's steps, and a later
    # sitting that runs other arms alone, in this folder or in a new one from the records, trains them as many steps
    # and reads back every arm-seed already measured instead of refusing or training it again.
    def study(run: Path, *overrides: str):
        config = load_config(ROOT / "recipes" / "tiny.yaml", [f"model.path={tiny_model_dir}", *SMALL, "evidence.n=4",
                                                              "evidence.drift_n=2", "evidence.seeds=[0]",
                                                              *overrides])
        return run_evidence(config, RunDir(run))

    first = study(tmp_path / "run", "evidence.main_arms=[mixture]", "train.max_steps=3")
    assert first["arms"]["mixture"]["steps"] == 3
    folder = tmp_path / "run" / "evidence"
    stamps = {p: p.stat().st_mtime_ns for p in folder.rglob("*.safetensors")}
    alone = study(tmp_path / "run", "evidence.main_arms=[gold, mixture]", "train.max_steps=-1")
    assert {arm["steps"] for arm in alone["arms"].values()} == {3}  # gold's own epochs are 6 steps here
    assert all(p.stat().st_mtime_ns == t for p, t in stamps.items())  # the mixture's seed 0 was not trained again

    records = tmp_path / "records"
    assert main(["grades", str(folder), str(records)]) == 0
    capsys.readouterr()
    again = study(tmp_path / "fresh", "evidence.main_arms=[gold]", "train.max_steps=-1",
                  f"evidence.records={records}")
    assert "evidence: arm gold, seed 0 read from the records" in capsys.readouterr().out
    assert again["arms"]["gold"] == alone["arms"]["gold"] and not list((tmp_path / "fresh").rglob("train"))
    # The study's first arm-seed trained by epochs, as it does where the recipe sets no train.max_steps (here its
    # record is made so): having trained the study's steps, it is read back, not trained again.
    settings = records / "mixture" / "seed-0" / "train-settings.json"
    stored = json.loads(settings.read_text())
    stored["record"]["train"]["max_steps"] = -1
    settings.write_text(json.dumps(stored))
    capsys.readouterr()
    study(tmp_path / "fresh", "evidence.main_arms=[mixture]", "train.max_steps=-1", f"evidence.records={records}")
    assert "evidence: arm mixture, seed 0 read from the records" in capsys.readouterr().out
    assert not list((tmp_path / "fresh").rglob("train"))
    # Records of two studies mixed in one folder: which steps to train is not guessed.
    metrics = records / "gold" / "seed-0" / "train-metrics.json"
    metrics.write_text(json.dumps({**json.loads(metrics.read_text()), "steps": 5}))
    with pytest.raises(ConfigError, match=r"trained different steps \(.*gold/seed-0: 5.*mixture/seed-0: 3"):
        study(tmp_path / "other", "evidence.main_arms=[redo]", "train.max_steps=-1", f"evidence.records={records}")


def test_the_base_answers_saved_for_more_questions_serve_fewer_and_never_other_ones(tmp_path) -> None:
    here = RunDir(tmp_path)
    assert saved_answers(here, ["a"]) is None
    atomic_write_json(tmp_path / "general_answers.json", {"questions": ["a", "b", "c"], "answer_ids": [[1], [2], [3]]})
    assert saved_answers(here, ["a", "b"]) == [[1], [2]]
    assert saved_answers(here, ["a", "b", "c"]) == [[1], [2], [3]]
    assert saved_answers(here, ["a", "x"]) is None
    assert saved_answers(here, ["a", "b", "c", "d"]) is None


def test_paired_arms_counts_and_interval() -> None:
    reference = {0: {"test": {"a": True, "b": False, "c": False, "d": True}},
                 1: {"test": {"a": True, "b": True, "c": False, "d": True}}}
    other = {0: {"test": {"a": True, "b": True, "c": True, "d": False}},
             1: {"test": {"a": True, "b": True, "c": True, "d": True}}}
    result = paired_arms(reference, other, "test")
    # seed 0: gained b, c; lost d. seed 1: gained c. Per problem: a 0, b +1/2, c +1, d -1/2 -> mean +0.25.
    assert (result["gained"], result["lost"], result["problems"], result["seeds"]) == (3, 1, 4, 2)
    assert result["change"] == 0.25 and result["low"] <= 0.25 <= result["high"]
    same = paired_arms(reference, reference, "test")
    assert same["change"] == same["low"] == same["high"] == 0 and same["mcnemar_p"] == 1.0


def test_a_wrong_forgetting_entry_is_refused_by_its_index_before_anything_runs() -> None:
    def tasks(*entries: str) -> dict:
        return forgetting_tasks(load_config(ROOT / "recipes" / "tiny.yaml", [f"evidence.forgetting={list(entries)}"]))

    assert list(tasks("tiny", "qwen2.5-coder-0.5b-gsm8k eval.n=200")) == ["arith", "gsm8k"]
    assert tasks("qwen2.5-coder-0.5b-gsm8k eval.n=200")["gsm8k"].eval.n == 200
    with pytest.raises(ConfigError, match=r"evidence.forgetting\[1\] .*eval.nn"):
        tasks("tiny", "qwen2.5-coder-0.5b-gsm8k eval.nn=200")
    with pytest.raises(ConfigError, match=r"evidence.forgetting\[0\] .*recipe not found: no-such-recipe"):
        tasks("no-such-recipe")
    with pytest.raises(ConfigError, match=r"evidence.forgetting\[1\] .*task 'arith' a second time"):
        tasks("tiny", "tiny task.arith.steps_max=4")
    with pytest.raises(ConfigError, match="empty entry"):
        tasks(" ")


def test_the_config_checks_and_describes_the_arms_from_the_stage_table() -> None:
    import dataclasses

    from redumix.pipeline.config import EvidenceConfig
    from redumix.pipeline.evidence_arms import ARMS, HARVESTS

    assert {arm.harvest for arm in ARMS.values()} <= set(HARVESTS)
    [main_arms] = [f for f in dataclasses.fields(EvidenceConfig) if f.name == "main_arms"]
    assert all(f"{name}: {arm.help}" in main_arms.metadata["help"] for name, arm in ARMS.items())
    with pytest.raises(ConfigError, match="unknown arms"):
        load_config(None, ["evidence.other_arms=[mixture, lambda1]"])
