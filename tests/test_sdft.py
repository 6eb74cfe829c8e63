"""SDFT through TRL (train.method=sdft, train/sdft.py) on a tiny random model: each teacher kind trains, writes what
`redumix evidence` reads, shows its teacher x2's conversation, keeps its EMA teacher in checkpoints and resumes."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, TrainerCallback

from bench.models import build_train_tokenizer
from redumix.data.chat import prompt_ids
from redumix.data.prompts import REDO, attempt_messages, redo_messages
from redumix.pipeline.config import load_config
from redumix.pipeline.evidence_arms import ARMS
from redumix.pipeline.run import RunDir
from redumix.pipeline.train import run_train, train_settings
from redumix.train.config import TrainConfig
from redumix.train.data import load_harvest
from redumix.train.sdft import EMA_TEACHER, TEACHER_ADAPTER
from tests.conftest import one_thread
from tests.train_fixtures import write_base, write_harvest

FAST = ["train.method=sdft", "train.batch_size=4", "train.learning_rate=0.005", "train.warmup_ratio=0.0",
        "train.logging_steps=1", "train.heldout_fraction=0.2", "train.lora_rank=8", "train.lora_alpha=16",
        "train.onpolicy_max_new_tokens=8", "train.max_steps=2", "train.save_steps=1"]
EMA_RATE = 0.05  # TRL's teacher_update_rate, which sdft keeps


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run on one thread: every step samples token by token, and a second thread's sync cost dwarfs a
    tiny forward on busy shared cores (docs/measurements.md, "Tests"; here 0.2 s/step on one, up to 5 s on two)."""
    with one_thread():
        yield


def _run(tmp_path: Path, n_rows: int = 20) -> RunDir:
    run = RunDir(tmp_path / "run")
    write_base(run.embedded)
    write_harvest(run.harvest, n_rows=n_rows, length=8)
    return run


class _TeacherInputs(TrainerCallback):
    """Keeps what TRL hands its callbacks once a batch's student and teacher inputs are built."""

    def __init__(self) -> None:
        self.batches: list[dict[str, torch.Tensor]] = []

    def on_self_distillation_batch_prepared(self, args: Any, state: Any, control: Any, **batch: Any) -> None:
        self.batches.append({k: batch[k].cpu() for k in ("prompt_ids", "completion_ids", "teacher_input_ids",
                                                         "teacher_attention_mask")})


def _unpadded(ids: torch.Tensor, pad: int) -> list[int]:
    """A left-padded row without its padding (the fixture's prompts never start with the pad id)."""
    ids = ids.tolist()
    return ids[next(i for i, t in enumerate(ids) if t != pad):]


@pytest.mark.parametrize(("teacher", "adapter"), [("base", "lora"), ("ema", "full"), ("ema", "lora")])
def test_sdft_trains_and_its_teacher_sees_x2(tmp_path: Path, teacher: str, adapter: str) -> None:
    run = _run(tmp_path)
    seen = _TeacherInputs()
    config = load_config(None, [*FAST, f"train.sdft_teacher={teacher}", f"train.adapter={adapter}"])
    result = run_train(config, run, callbacks=[seen])

    # What the evidence summary and its paired comparisons read.
    assert result["steps"] == 2 and result["method"] == f"sdft-{teacher}"
    assert result["seconds_per_step"] > 0 and result["wall_seconds"] > 0 and result["inputs"]["harvest"]
    assert math.isfinite(result["heldout_kl_base"]) and math.isfinite(result["heldout_kl_merged"])
    assert result["heldout_kl_merged"] != result["heldout_kl_base"]
    assert result["rows"]["train"] + result["rows"]["heldout"] == 20
    assert math.isfinite(result["final_loss"]) and result["final_loss"] > 0

    # The merged model loads with plain transformers, with its tokenizer, and training moved it.
    merged = AutoModelForCausalLM.from_pretrained(str(run.train / "merged"))
    base = AutoModelForCausalLM.from_pretrained(str(run.embedded))
    assert (run.train / "merged" / "tokenizer_config.json").is_file()
    q_proj = merged.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(q_proj, base.model.layers[0].self_attn.q_proj.weight)
    assert (run.train / "adapter").is_dir() == (adapter == "lora")

    # The teacher's prompt is x2's conversation exactly; the student's is x alone, of the same row.
    tokenizer = build_train_tokenizer()
    rows = load_harvest(run.harvest)
    x_of_x2 = {}
    for r in rows:
        x2 = prompt_ids(tokenizer, redo_messages(r["prompt"], r["original"], r["feedback"], r["reflection"]))
        x_of_x2[tuple(x2)] = prompt_ids(tokenizer, attempt_messages(r["prompt"]))
    assert len(seen.batches) == 2  # one rollout batch a step (grad_accum 1)
    batch = seen.batches[0]
    completion = batch["completion_ids"].shape[1]
    for b in range(batch["teacher_input_ids"].shape[0]):
        mask = batch["teacher_attention_mask"][b, :-completion].bool()
        teacher_prompt = batch["teacher_input_ids"][b, :-completion][mask].tolist()
        assert tuple(teacher_prompt) in x_of_x2
        assert _unpadded(batch["prompt_ids"][b], tokenizer.pad_token_id) == x_of_x2[tuple(teacher_prompt)]
        text = tokenizer.decode(teacher_prompt)
        assert "<|assistant|>12<eos>" in text and "The answer is wrong." in text and "Recheck." in text
        assert text.endswith(f"{REDO}<eos><|assistant|>")
        assert torch.equal(batch["teacher_input_ids"][b, -completion:], batch["completion_ids"][b])


@pytest.mark.parametrize("adapter", ["full", "lora"])
def test_the_ema_teacher_is_in_the_checkpoint(tmp_path: Path, adapter: str) -> None:
    """After one step the EMA teacher is (1 - rate)·start + rate·student: full weights, or with LoRA the adapter
    factors (TRL's teacher adapter starts at zero, the starting model)."""
    run = _run(tmp_path)
    run_train(load_config(None, [*FAST, "train.sdft_teacher=ema", f"train.adapter={adapter}"]), run)
    checkpoint = run.train / "checkpoints" / "checkpoint-1"
    if adapter == "full":
        teacher = torch.load(checkpoint / EMA_TEACHER, weights_only=True)
        student = load_file(str(checkpoint / "model.safetensors"))
        start = load_file(str(run.embedded / "model.safetensors"))
        moved = [k for k in student if not torch.equal(student[k], start[k])]
        assert moved
        for key in student:
            expected = (1 - EMA_RATE) * start[key] + EMA_RATE * student[key]
            torch.testing.assert_close(teacher[key], expected, atol=1e-6, rtol=0)
    else:
        teacher = load_file(str(checkpoint / TEACHER_ADAPTER / "adapter_model.safetensors"))
        student = load_file(str(checkpoint / "adapter_model.safetensors"))
        assert set(teacher) == set(student)
        for key in student:
            torch.testing.assert_close(teacher[key], EMA_RATE * student[key], atol=1e-7, rtol=0)


class _Crash(TrainerCallback):
    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.at_step:
            raise KeyboardInterrupt("simulated kill")


@pytest.mark.parametrize("adapter", ["full", "lora"])
def test_an_ema_run_resumes_to_the_model_of_an_unbroken_one(tmp_path: Path, adapter: str) -> None:
    """The resumed run restores the EMA teacher from the checkpoint (TRL alone would restart it from the start)."""
    settings = [*FAST, "train.sdft_teacher=ema", f"train.adapter={adapter}", "train.max_steps=4",
                "train.save_steps=2"]
    whole = _run(tmp_path / "whole")
    result = run_train(load_config(None, settings), whole)

    broken = _run(tmp_path / "broken")
    with pytest.raises(KeyboardInterrupt):
        run_train(load_config(None, settings), broken, callbacks=[_Crash(at_step=3)])  # last checkpoint: step 2
    resumed = run_train(load_config(None, settings), broken)
    assert resumed["steps"] == 4
    assert resumed["final_loss"] == pytest.approx(result["final_loss"], abs=1e-6)
    a = load_file(str(whole.train / "merged" / "model.safetensors"))
    b = load_file(str(broken.train / "merged" / "model.safetensors"))
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_sdft_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="method 'sdft' learns from its own samples"):
        TrainConfig(method="sdft", target="redo")
    with pytest.raises(ValueError, match="one temperature"):
        TrainConfig(method="sdft", temperature=2.0)
    for name in ("sdft-base", "sdft-ema"):
        settings = dataclasses.replace(TrainConfig(), **ARMS[name].train)
        assert settings.method == "sdft" and settings.sdft_teacher == name.removeprefix("sdft-")


def test_the_sampler_is_recorded_off_its_default_only() -> None:
    """Settings recorded before `train.sdft_sampler` existed (every arm in docs/records) match the default's, and
    the other arms' when a study sets the sampler for its SDFT arm."""
    assert "sdft_sampler" not in train_settings(load_config(None, FAST))["train"]
    assert train_settings(load_config(None, [*FAST, "train.sdft_sampler=vllm"]))["train"]["sdft_sampler"] == "vllm"
    assert "sdft_sampler" not in train_settings(load_config(None, ["train.sdft_sampler=vllm"]))["train"]
