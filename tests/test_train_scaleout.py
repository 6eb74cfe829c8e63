"""The real-model recipe's keys on a tiny random Qwen2, and 2-process DeepSpeed ZeRO-2/3 runs on CPU through the
same torchrun command the Makefile uses for NPROC=2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from redumix.pipeline.config import load_config
from redumix.pipeline.run import RunDir
from redumix.pipeline.train import run_train
from tests.train_fixtures import write_base, write_harvest

ROOT = Path(__file__).resolve().parents[1]
QWEN_RECIPE = ROOT / "recipes" / "qwen2.5-1.5b-gsm8k.yaml"


def test_qwen_recipe_keys_on_a_tiny_qwen2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the recipe names recipes/zero3.json relative to the repository
    model_dir = write_base(tmp_path / "qwen", arch="qwen2")
    run = RunDir(tmp_path / "run")
    write_harvest(run.harvest, n_rows=16, length=8)
    # Everything from the recipe except what needs 8 GPUs: one CPU process, no DeepSpeed, float32 weights.
    config = load_config(QWEN_RECIPE, [f"model.path={model_dir}", "model.dtype=float32", "train.deepspeed=",
                                       "train.max_steps=2", "train.batch_size=4", "train.grad_accum=1",
                                       "train.gradient_checkpointing=false"])
    assert config.train.adapter == "lora" and config.train.lora_rank == 16
    result = run_train(config, run)
    assert result["steps"] == 2
    adapter = json.loads((run.train / "adapter" / "adapter_config.json").read_text())
    assert set(adapter["target_modules"]) == set(config.train.lora_target_modules)
    assert AutoModelForCausalLM.from_pretrained(str(run.train / "merged")).config.model_type == "qwen2"


def _torchrun(run: Path, zero: str) -> subprocess.CompletedProcess:
    recipe = run / "recipe.yaml"
    recipe.write_text("name: scaleout\n")
    command = [
        str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", "2",
        "-m", "redumix.pipeline.cli", "train", "--recipe", str(recipe), "--run-dir", str(run),
        f"train.deepspeed=recipes/{zero}.json", "train.max_steps=3", "train.batch_size=2", "train.save_steps=2",
        "train.logging_steps=1", "train.heldout_fraction=0.2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_two_process_deepspeed_takes_three_steps(tmp_path: Path, zero: str) -> None:
    run = tmp_path / "run"
    write_base(run / "embedded")
    write_harvest(run / "harvest", n_rows=16, length=8)
    done = _torchrun(run, zero)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((run / "train" / "metrics.json").read_text())
    assert result["steps"] == 3
    # save_steps=2: checkpoint-2 is kept; none is taken at the last step (train/trainer.py, NoFinalCheckpoint).
    checkpoint = run / "train" / "checkpoints" / "checkpoint-2"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 2
    assert not (run / "train" / "checkpoints" / "checkpoint-3").exists()
    # Both ranks trained: the DeepSpeed checkpoint holds one optimizer partition per rank.
    assert len(list(checkpoint.rglob("*optim_states.pt"))) == 2
    AutoModelForCausalLM.from_pretrained(str(run / "train" / "merged"))
