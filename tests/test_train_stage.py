"""The train stage end to end on a tiny random model and bigram-teacher shards: outputs, learning, skip, resume."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, TrainerCallback

from bench.models import build_train_tokenizer
from redumix.pipeline.config import load_config
from redumix.pipeline.run import RunDir
from redumix.pipeline.train import run_train
from redumix.train.config import RowFilter
from redumix.train.data import (
    ROW_FILTERS,
    SparseTeacherCollator,
    build_examples,
    filter_rows,
    load_harvest,
    split_heldout,
)
from redumix.train.loss import select_targets, sparse_gkd_loss
from tests.train_fixtures import write_base, write_harvest

FAST = ["train.batch_size=8", "train.learning_rate=0.005", "train.warmup_ratio=0.0", "train.logging_steps=1",
        "train.heldout_fraction=0.2", "train.lora_rank=8", "train.lora_alpha=16"]


def _run(tmp_path: Path, n_rows: int = 48) -> RunDir:
    run = RunDir(tmp_path / "run")
    write_base(run.embedded)
    write_harvest(run.harvest, n_rows=n_rows, length=16)
    return run


def test_stage_trains_lora_merges_and_lowers_heldout_kl(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = _run(tmp_path, n_rows=64)
    config = load_config(None, [*FAST, "train.max_steps=16", "train.save_steps=8"])
    result = run_train(config, run)

    adapter = load_file(str(run.train / "adapter" / "adapter_model.safetensors"))
    lora_b = [t for name, t in adapter.items() if "lora_B" in name]
    assert lora_b and all(t.abs().sum() > 0 for t in lora_b)  # peft initialises B to zero: training moved it
    merged = AutoModelForCausalLM.from_pretrained(str(run.train / "merged"))  # plain transformers, no peft
    base = AutoModelForCausalLM.from_pretrained(str(run.embedded))
    q_proj = merged.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(q_proj, base.model.layers[0].self_attn.q_proj.weight)
    assert (run.train / "merged" / "tokenizer_config.json").is_file()
    assert "train:" in (run.train / "config.yaml").read_text()

    assert result["steps"] == 16
    assert result["heldout_kl_merged"] < result["heldout_kl_base"]
    assert json.loads((run.train / "metrics.json").read_text()) == result
    logged = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    assert any(line["stage"] == "train" and "loss" in line for line in logged)

    assert run_train(config, run) == result  # complete: skipped
    assert "already complete" in capsys.readouterr().out
    # How it runs may change; what it trained may not, even in a folder from before settings.json (its config.yaml)
    relogged = load_config(None, [*FAST, "train.max_steps=16", "train.save_steps=4", "train.logging_steps=2"])
    assert run_train(relogged, run) == result
    (run.train / "settings.json").unlink()
    with pytest.raises(ValueError, match=r"train\.learning_rate: 0\.005 -> 0\.01.*delete .*train to train again"):
        run_train(load_config(None, [*FAST, "train.max_steps=16", "train.learning_rate=0.01"]), run)
    assert json.loads((run.train / "metrics.json").read_text()) == result


def test_full_finetune_writes_merged_only(tmp_path: Path) -> None:
    run = _run(tmp_path, n_rows=16)
    run_train(load_config(None, [*FAST, "train.adapter=full", "train.max_steps=2"]), run)
    assert not (run.train / "adapter").exists()
    AutoModelForCausalLM.from_pretrained(str(run.train / "merged"))


def test_report_to_tensorboard_writes_an_events_file(tmp_path: Path) -> None:
    run = _run(tmp_path, n_rows=16)
    overrides = [*FAST, "train.adapter=full", "train.max_steps=2", "train.report_to=tensorboard"]
    run_train(load_config(None, overrides), run)
    events = list((run.train / "checkpoints" / "runs").glob("*/events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(events[0].parent))
    accumulator.Reload()
    assert "train/loss" in accumulator.Tags()["scalars"]


def test_report_to_without_its_package_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from redumix.train.trainer import check_report_to

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="train.report_to=wandb needs the wandb package"):
        check_report_to("wandb")
    check_report_to("none")  # needs nothing


def test_row_filters_and_heldout_split(tmp_path: Path) -> None:
    write_harvest(tmp_path, n_rows=30, length=4)
    rows = load_harvest(tmp_path)
    # The fixture: original right when i % 3 == 0, redo right when i % 2 == 0.
    assert len(filter_rows(rows, "all")) == 30
    assert len(filter_rows(rows, "redo_correct")) == 15
    assert len(filter_rows(rows, "improved")) == len([i for i in range(30) if i % 2 == 0 and i % 3 != 0])
    right = filter_rows(rows, "original_correct")  # the `rft` arm's rows: the model's own right first attempts
    assert len(right) == 10 and all(right["original_correct"])
    assert set(typing.get_args(RowFilter)) == {"all", *ROW_FILTERS}  # every filter the config accepts has its rule
    train, held = split_heldout(rows, 0.3)
    assert len(train) + len(held) == 30 and 0 < len(held) < 30
    assert set(split_heldout(rows.shuffle(seed=1), 0.3)[1]["id"]) == set(held["id"])  # by id, not by order


def test_the_rft_arm_learns_only_the_right_first_attempts(tmp_path: Path) -> None:
    from redumix.pipeline.evidence_arms import ARMS

    run = _run(tmp_path, n_rows=30)  # original right when i % 3 == 0: 10 rows
    settings = [f"train.{key}={value}" for key, value in ARMS["rft"].train.items()]
    result = run_train(load_config(None, [*FAST, *settings, "train.max_steps=2", "train.heldout_fraction=0.0"]), run)
    assert result["rows"]["harvested"] == 30 and result["rows"]["selected"] == result["rows"]["train"] == 10
    assert result["steps"] == 2


def test_collator_aligns_teacher_with_targets(tmp_path: Path) -> None:
    write_harvest(tmp_path, n_rows=3, length=5)
    tokenizer = build_train_tokenizer()
    examples = build_examples(load_harvest(tmp_path), tokenizer, max_length=1024)
    short = build_examples(load_harvest(tmp_path), tokenizer, max_length=len(examples[0]["input_ids"]) - 2)
    assert len(short[0]["teacher_ids"]) == 3  # the redo is cut to fit, and its teacher with it
    batch = SparseTeacherCollator(pad_token_id=tokenizer.pad_token_id)([examples[0], short[1]])
    targets = batch["labels"][:, 1:][batch["labels"][:, 1:] != -100]
    teacher_ids = batch["teacher_ids"][batch["teacher_mask"]]
    assert len(targets) == len(teacher_ids) == 5 + 3
    rows = load_harvest(tmp_path)
    expected = list(rows[0]["redo_token_ids"]) + list(rows[1]["redo_token_ids"][:3])
    assert targets.tolist() == expected
    assert teacher_ids[0].tolist() == rows[0]["mix_topk_ids"][0]


@pytest.mark.parametrize("target", ["redo", "gold", "original"])
def test_hard_label_targets_are_cross_entropy_on_their_text(tmp_path: Path, target: str) -> None:
    write_harvest(tmp_path, n_rows=3, length=5)
    tokenizer = build_train_tokenizer()
    rows = load_harvest(tmp_path)
    solutions = {r["id"]: f"{r['reference']} is it." for r in rows}
    examples = build_examples(rows, tokenizer, 1024, target=target, solutions=solutions)
    texts = {"redo": rows["redo"], "gold": [solutions[i] for i in rows["id"]], "original": rows["original"]}[target]
    end = tokenizer.convert_tokens_to_ids("<eos>")  # the template closes an assistant turn with it
    for example, text in zip(examples, texts, strict=True):
        y = example["input_ids"][example["prompt_length"] :]
        assert y == tokenizer(text, add_special_tokens=False)["input_ids"] + [end]
        assert example["teacher_ids"] == [[t] for t in y]
    batch = SparseTeacherCollator(pad_token_id=tokenizer.pad_token_id)(list(examples))
    logits = torch.randn(batch["input_ids"].shape[0], batch["input_ids"].shape[1], len(tokenizer))
    student, labels = select_targets(logits, batch["labels"])
    mask = batch["teacher_mask"]
    loss = sparse_gkd_loss(student, batch["teacher_ids"][mask], batch["teacher_logprobs"][mask],
                           tail_logprob=batch["teacher_tail"][mask])
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(student, labels), atol=1e-6, rtol=0)


def test_gold_target_names_rows_without_a_solution(tmp_path: Path) -> None:
    write_harvest(tmp_path, n_rows=3, length=5)
    with pytest.raises(ValueError, match="no reference working for 1 rows"):
        build_examples(load_harvest(tmp_path), build_train_tokenizer(), 1024, target="gold",
                       solutions={"t-00000": "1", "t-00001": "2"})


def test_gradient_accumulation_gives_the_same_step(tmp_path: Path) -> None:
    """Loss normalised by the token count of the whole accumulated batch: 1x8 and 4x2 give the same gradient."""
    run = _run(tmp_path, n_rows=10)
    norms = []
    for batch, accum in [(8, 1), (2, 4)]:
        out = RunDir(tmp_path / f"run-{batch}")
        out.root.mkdir()
        (out.root / "embedded").symlink_to(run.embedded)
        (out.root / "harvest").symlink_to(run.harvest)
        config = load_config(None, [*FAST, "train.adapter=full", "train.max_steps=1", "train.bf16=false",
                                    f"train.batch_size={batch}", f"train.grad_accum={accum}"])
        run_train(config, out)
        logged = [json.loads(line) for line in out.metrics.read_text().splitlines()]
        norms.append(next(entry["grad_norm"] for entry in logged if "grad_norm" in entry))
    assert norms[0] == pytest.approx(norms[1], rel=1e-4)


class _Crash(TrainerCallback):
    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
        if state.global_step == self.at_step:
            raise KeyboardInterrupt("simulated kill")


def test_resume_matches_uninterrupted_run(tmp_path: Path) -> None:
    settings = [*FAST, "train.max_steps=6", "train.save_steps=2", "train.batch_size=4", "train.lora_dropout=0.1"]
    whole = _run(tmp_path / "whole", n_rows=24)
    result = run_train(load_config(None, settings), whole)

    broken = _run(tmp_path / "broken", n_rows=24)
    with pytest.raises(KeyboardInterrupt):
        run_train(load_config(None, settings), broken, callbacks=[_Crash(at_step=5)])  # last checkpoint: step 4
    assert not (broken.train / "metrics.json").exists()
    with pytest.raises(ValueError, match=r"other settings \(train\.seed: 0 -> 1\)"):  # not resumed under another seed
        run_train(load_config(None, [*settings, "seed=1"]), broken)
    assert (broken.train / "checkpoints" / "checkpoint-4").is_dir()
    resumed = run_train(load_config(None, [*settings, "train.seed=0"]), broken)  # the same seed, set another way
    assert resumed["steps"] == 6
    assert resumed["final_loss"] == pytest.approx(result["final_loss"], abs=1e-5)
    a = load_file(str(whole.train / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(broken.train / "adapter" / "adapter_model.safetensors"))
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


@pytest.mark.parametrize(("ratio", "steps", "warmup"), [(0.03, 100, 3), (0.1, 246, 25), (0.0, 50, 0)])
def test_warmup_ratio_reaches_the_trainer_as_a_ratio(ratio: float, steps: int, warmup: int, tmp_path: Path) -> None:
    from redumix.train.trainer import training_arguments

    config = load_config(None, [f"train.warmup_ratio={ratio}"]).train
    args = training_arguments(config, str(tmp_path), seed=0, use_cpu=True, processes=1)
    assert args.get_warmup_steps(steps) == warmup  # ceil(ratio * steps)


def test_a_crash_after_the_last_step_reruns_to_the_same_model(tmp_path: Path) -> None:
    """No checkpoint is kept at the last step (HF Trainer would train one step more from it): a crash between the
    last step and the outputs resumes one checkpoint earlier and redoes the last steps exactly."""
    import shutil

    settings = [*FAST, "train.max_steps=6", "train.save_steps=2", "train.batch_size=4"]
    run = _run(tmp_path, n_rows=24)
    first = run_train(load_config(None, settings), run)
    assert sorted(p.name for p in (run.train / "checkpoints").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    weights = load_file(str(run.train / "adapter" / "adapter_model.safetensors"))
    (run.train / "metrics.json").unlink()
    shutil.rmtree(run.train / "adapter")
    shutil.rmtree(run.train / "merged")
    again = run_train(load_config(None, settings), run)
    assert again["steps"] == first["steps"] == 6
    assert again["final_loss"] == pytest.approx(first["final_loss"], abs=1e-5)
    rerun = load_file(str(run.train / "adapter" / "adapter_model.safetensors"))
    assert all(torch.allclose(weights[k], rerun[k], atol=1e-5) for k in weights)


def test_resume_skips_a_checkpoint_that_was_not_finished(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A kill while HF Trainer saves leaves the newest checkpoint without trainer_state.json (written last), or with
    it cut short: resume from the newest finished one instead (a SIGKILL test in CI found this)."""
    from redumix.pipeline.train import last_complete_checkpoint

    folder = tmp_path / "checkpoints"
    assert last_complete_checkpoint(folder) is None
    for step, state in ((2, '{"global_step": 2}'), (4, '{"global_step": 4}'), (6, None), (8, '{"global_st')):
        (folder / f"checkpoint-{step}").mkdir(parents=True)
        (folder / f"checkpoint-{step}" / "model.safetensors").write_bytes(b"")
        if state is not None:
            (folder / f"checkpoint-{step}" / "trainer_state.json").write_text(state)
    (folder / "checkpoint-x").mkdir()
    assert last_complete_checkpoint(folder) == str(folder / "checkpoint-4")
    out = capsys.readouterr().out
    assert "checkpoint-8 was not finished" in out and "checkpoint-6 was not finished" in out
