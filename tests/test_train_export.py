"""`redumix export` writes the DPO pairs and the SFT set as JSONL, Parquet and Hugging Face datasets on disk, and
TRL's DPOTrainer and SFTTrainer train on the dataset folders as they are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset, load_from_disk
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

from bench.models import build_train_model, build_train_tokenizer
from redumix.pipeline.config import load_config
from redumix.pipeline.export import run_export
from redumix.pipeline.run import RunDir
from tests.train_fixtures import write_harvest

# The fixture marks rows i % 3 == 0 as originally right and i % 2 == 0 as redone right.
FIXED = [i for i in range(24) if i % 2 == 0 and i % 3 != 0]
REDONE_RIGHT = [i for i in range(24) if i % 2 == 0]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    run = RunDir(tmp_path_factory.mktemp("export") / "run")
    write_harvest(run.harvest, n_rows=24, length=12)
    result = run_export(load_config(None), run)
    assert run_export(load_config(None), run) == result  # complete: skipped
    assert load_config(run.root / "export" / "config.yaml") == load_config(None)  # the resolved config beside them
    return run.root / "export", result


def test_export_writes_each_set_three_ways(exported: tuple[Path, dict]) -> None:
    out, result = exported
    assert result["pairs"] == len(FIXED) and result["sft"] == {"redo": len(REDONE_RIGHT), "reflection": len(FIXED)}
    pairs = [json.loads(line) for line in (out / "dpo.jsonl").read_text().splitlines()]
    assert [p["id"] for p in pairs] == [f"t-{i:05d}" for i in FIXED]
    assert pairs[0]["prompt"][0]["role"] == "user" and pairs[0]["chosen"][0]["role"] == "assistant"
    for name in ("dpo", "sft"):
        on_disk, parquet = load_from_disk(str(out / name)), Dataset.from_parquet(str(out / f"{name}.parquet"))
        lines = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
        assert on_disk.to_list() == parquet.to_list() == lines
        assert result["sets"][name]["rows"] == len(lines)
    sft = load_from_disk(str(out / "sft"))
    redo = sft.filter(lambda r: r["kind"] == "redo")
    assert redo["id"] == [f"t-{i:05d}" for i in REDONE_RIGHT] and len(redo[0]["prompt"]) == 1
    reflection = sft.filter(lambda r: r["kind"] == "reflection")[0]
    # [x ‖ y1 ‖ r ‖ REFLECT] -> c
    assert [m["role"] for m in reflection["prompt"]] == ["user", "assistant", "user"]
    assert reflection["prompt"][2]["content"].startswith("The answer is wrong.")
    assert reflection["completion"] == [{"role": "assistant", "content": "Recheck."}]


def test_dpo_trainer_steps_on_the_exported_folder(exported: tuple[Path, dict], tmp_path: Path) -> None:
    out, _ = exported
    tokenizer = build_train_tokenizer()
    model = build_train_model(len(tokenizer), seed=3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = DPOConfig(
        output_dir=str(tmp_path / "dpo"), max_steps=1, per_device_train_batch_size=2, learning_rate=1e-2,
        use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1,
    )
    reference = build_train_model(len(tokenizer), seed=3)  # the same init: DPO's frozen reference
    trainer = DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=load_from_disk(str(out / "dpo")),
                         processing_class=tokenizer)
    trainer.train()
    assert trainer.state.global_step == 1
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_sft_trainer_steps_on_the_exported_folder(exported: tuple[Path, dict], tmp_path: Path) -> None:
    out, _ = exported
    tokenizer = build_train_tokenizer()
    model = build_train_model(len(tokenizer), seed=3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = SFTConfig(
        output_dir=str(tmp_path / "sft"), max_steps=1, per_device_train_batch_size=2, learning_rate=1e-2,
        use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=load_from_disk(str(out / "sft")),
                         processing_class=tokenizer)
    trainer.train()
    assert trainer.state.global_step == 1 and trainer.state.log_history[0]["loss"] > 0
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
