"""On-policy mixture distillation: the live teacher is the harvest's p_mix, the LoRA teacher is the adapter-disabled
model, and a training run really samples from the student on a fraction on_policy_share of its steps."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from bench.models import build_tiny_model
from redumix.data.chat import prompt_ids
from redumix.data.prompts import attempt_messages
from redumix.generate.model_io import stop_token_ids
from redumix.generate.policy import SamplingPolicy
from redumix.pipeline.config import load_config
from redumix.pipeline.run import RunDir
from redumix.pipeline.train import run_train
from redumix.train.onpolicy import LiveMixtureTeacher
from redumix.train.trainer import SparseGKDTrainer
from tests.test_redumix import IDS, PROMPTS, run
from tests.train_fixtures import write_base, write_harvest


def _teacher(model, tokenizer, frozen, topk: int = 8) -> LiveMixtureTeacher:
    return LiveMixtureTeacher(frozen, topk, SamplingPolicy(temperature=1.0, max_new_tokens=12),
                              stop_token_ids(model, tokenizer), tokenizer.pad_token_id, 4096, seed=0)


@pytest.mark.parametrize("lam", [0.3, 0.5])
@pytest.mark.parametrize("window", [2048, 0])  # 0: a window so tight that the harvest cut the attempt
def test_live_teacher_equals_the_harvested_pmix(tiny_tokenizer, lam: float, window: int) -> None:
    policy = SamplingPolicy(temperature=1.0, max_new_tokens=30)
    model = build_tiny_model(tiny_tokenizer, max_positions=window or 2048)
    if not window:  # as in test_redumix's overflow test: 4 tokens short of the worst case
        [full] = run(model, tiny_tokenizer, lam=lam, policy=policy, prompts=PROMPTS[:1], ids=IDS[:1], topk=8)
        window = full.meta["tokens"]["x2"] - full.meta["tokens"]["reflection"] + 10 + 30 - 4
        model = build_tiny_model(tiny_tokenizer, max_positions=window)
    results = run(model, tiny_tokenizer, lam=lam, policy=policy, topk=8)
    if window < 2048:
        assert results[0].meta["y1_compressed_tokens"] > 0
    prompts = [prompt_ids(tiny_tokenizer, attempt_messages(p)) for p in PROMPTS]
    live = _teacher(model, tiny_tokenizer, frozen=model).targets(
        model, prompts, [r.x2_ids for r in results], [r.redo_token_ids for r in results],
        torch.full((len(results),), lam),
    )
    for r, (ids, logprobs, tail) in zip(results, live, strict=True):
        assert len(r.redo_token_ids) > 1
        assert len(r.x2_ids) == r.meta["tokens"]["x2"]
        torch.testing.assert_close(logprobs, torch.tensor(r.topk_logprobs), atol=1e-5, rtol=0)
        torch.testing.assert_close(tail, torch.tensor(r.tail_logprobs), atol=1e-5, rtol=0)
        assert ids.tolist() == r.topk_ids


def test_lora_teacher_is_the_adapter_disabled_model(tiny_tokenizer) -> None:
    base = build_tiny_model(tiny_tokenizer, arch="llama", seed=3)
    student = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # an adapter that changes the model, as training would
        for name, param in student.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    prompts = [prompt_ids(tiny_tokenizer, attempt_messages(p)) for p in PROMPTS]
    x2s = [p + prompt_ids(tiny_tokenizer, attempt_messages("Check it again.")) for p in prompts]
    ys = [[5 + i, 9, 12, 7 + i] for i in range(len(prompts))]
    lam = torch.full((len(prompts),), 0.5)
    adapted = _teacher(base, tiny_tokenizer, frozen=student).targets(student, prompts, x2s, ys, lam)
    student.train()
    from_lora = _teacher(base, tiny_tokenizer, frozen=None).targets(student, prompts, x2s, ys, lam)
    assert student.training  # the teacher left the student's mode as it found it
    from_base = _teacher(base, tiny_tokenizer, frozen=base).targets(base, prompts, x2s, ys, lam)
    adapted_after = _teacher(base, tiny_tokenizer, frozen=student).targets(student, prompts, x2s, ys, lam)
    for lora_row, base_row, adapted_row, after_row in zip(from_lora, from_base, adapted, adapted_after, strict=True):
        torch.testing.assert_close(lora_row[1], base_row[1], atol=1e-6, rtol=0)
        assert (lora_row[1] - adapted_row[1]).abs().max() > 1e-2  # the adapter was really off
        torch.testing.assert_close(after_row[1], adapted_row[1])  # and is on again afterwards


class _CountSamples:
    """Counts the student samples the live teacher draws (wraps the real method, which still runs)."""

    def __init__(self) -> None:
        self.batches = 0

    def __enter__(self) -> _CountSamples:
        self.original = LiveMixtureTeacher.on_policy_batch

        def counting(teacher, student, inputs, step):
            self.batches += 1
            return self.original(teacher, student, inputs, step)

        LiveMixtureTeacher.on_policy_batch = counting
        return self

    def __exit__(self, *exc: object) -> None:
        LiveMixtureTeacher.on_policy_batch = self.original


FAST = ["train.batch_size=8", "train.learning_rate=0.005", "train.warmup_ratio=0.0", "train.logging_steps=1",
        "train.heldout_fraction=0.2", "train.lora_rank=8", "train.lora_alpha=16", "train.policy=on_policy",
        "train.onpolicy_max_new_tokens=8", "train.max_steps=6", "train.save_steps=100"]


@pytest.mark.parametrize(("adapter", "share"), [("lora", 1.0), ("full", 0.5), ("lora", 0.0)])
def test_on_policy_training_samples_on_its_share_of_steps(tmp_path: Path, adapter: str, share: float) -> None:
    run_dir = RunDir(tmp_path / "run")
    write_base(run_dir.embedded)
    write_harvest(run_dir.harvest, n_rows=40, length=8)
    config = load_config(None, [*FAST, f"train.adapter={adapter}", f"train.on_policy_share={share}"])
    with _CountSamples() as counted:
        result = run_train(config, run_dir)
    draws = sum(SparseGKDTrainer.on_policy_step(_Seeded(config.seed, share), step) for step in range(6))
    assert counted.batches == draws
    drawn = sum(SparseGKDTrainer.on_policy_step(_Seeded(config.seed, share), step) for step in range(2000)) / 2000
    assert abs(drawn - share) < 0.04
    assert result["steps"] == 6 and result["policy"] == "on_policy"
    assert torch.isfinite(torch.tensor(result["final_loss"]))


class _Seeded:
    """What `on_policy_step` reads of a trainer: its seed and on_policy_share."""

    def __init__(self, seed: int, on_policy_share: float) -> None:
        self.args = type("Args", (), {"seed": seed})()
        self.on_policy_share = on_policy_share


def test_on_policy_needs_x2_ids(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run")
    write_base(run_dir.embedded)
    write_harvest(run_dir.harvest, n_rows=12, length=4, with_x2=False)
    with pytest.raises(ValueError, match="x2_token_ids"):
        run_train(load_config(None, [*FAST]), run_dir)
