"""`redumix export` writes DPO pairs, and TRL's DPOTrainer trains on them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from datasets import Dataset
from trl import DPOConfig, DPOTrainer

from bench.models import build_train_model, build_train_tokenizer
from redumix.pipeline.config import load_config
from redumix.pipeline.export import run_export
from redumix.pipeline.run import RunDir
from tests.train_fixtures import write_harvest


def test_export_then_dpo_two_steps(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    write_harvest(run.harvest, n_rows=24, length=12)
    result = run_export(load_config(None), run)
    # The fixture marks rows i % 3 == 0 as originally right and i % 2 == 0 as redone right.
    expected = [i for i in range(24) if i % 2 == 0 and i % 3 != 0]
    assert result["pairs"] == len(expected)
    pairs = [json.loads(line) for line in (run.root / "export" / "dpo.jsonl").read_text().splitlines()]
    assert [p["id"] for p in pairs] == [f"t-{i:05d}" for i in expected]
    assert pairs[0]["prompt"][0]["role"] == "user" and pairs[0]["chosen"][0]["role"] == "assistant"
    assert load_config(run.root / "export" / "config.yaml") == load_config(None)  # the resolved config beside them
    assert run_export(load_config(None), run) == result  # complete: skipped

    tokenizer = build_train_tokenizer()
    model = build_train_model(len(tokenizer), seed=3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    dataset = Dataset.from_list([{k: p[k] for k in ("prompt", "chosen", "rejected")} for p in pairs])
    args = DPOConfig(
        output_dir=str(tmp_path / "dpo"), max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2,
        use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1,
    )
    reference = build_train_model(len(tokenizer), seed=3)  # the same init: DPO's frozen reference
    trainer = DPOTrainer(
        model=model, ref_model=reference, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.train()
    assert trainer.state.global_step == 2
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
