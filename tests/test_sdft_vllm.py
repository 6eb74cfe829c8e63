"""SDFT with its samples drawn by TRL's vLLM (`train.sdft_sampler=vllm`, train/sdft.py) on a CPU: it trains, and
the weights vLLM samples from are the student's, not the starting model's (TRL's own sync fails on vLLM's CPU
backend; train/sdft.py syncs through vLLM's `reload_weights`). Skipped where vLLM is not installed (`make vllm`)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment; `make vllm` adds it")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from bench.models import build_train_tokenizer  # noqa: E402
from bench.sdft_sampling import sync_gaps  # noqa: E402
from redumix.pipeline.config import load_config  # noqa: E402
from redumix.train.data import load_harvest  # noqa: E402
from redumix.train.sdft import build_sdft_trainer, sdft_examples  # noqa: E402
from redumix.train.trainer import TrainerSetup  # noqa: E402
from tests.train_fixtures import write_harvest  # noqa: E402

SETTINGS = ["train.method=sdft", "train.sdft_sampler=vllm", "train.batch_size=4", "train.learning_rate=0.05",
            "train.warmup_ratio=0.0", "train.logging_steps=1", "train.lora_rank=8", "train.lora_alpha=16",
            "train.onpolicy_max_new_tokens=8", "train.max_steps=3", "train.save_steps=100", "train.max_length=1024"]


def _student_folder(folder: Path) -> Path:
    """The train tests' tokenizer on a random float32 Llama with head_dim 64 (vLLM's CPU attention rejects the tiny
    train model's 8)."""
    tokenizer = build_train_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                         eos_token_id=1, pad_token_id=0, bos_token_id=1, tie_word_embeddings=False)
    LlamaForCausalLM(config).float().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_sdft_samples_through_vllm_from_the_trained_student(tmp_path: Path) -> None:
    folder = _student_folder(tmp_path / "student")
    write_harvest(tmp_path / "harvest", n_rows=12, length=8)
    config = load_config(None, SETTINGS)
    tokenizer = build_train_tokenizer()
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    examples = sdft_examples(load_harvest(tmp_path / "harvest"), tokenizer, config.train.max_length,
                             config.train.onpolicy_max_new_tokens)
    trainer = build_sdft_trainer(model, tokenizer, examples, config.train,
                                 TrainerSetup(str(tmp_path / "checkpoints"), 0, True))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert trainer.state.global_step == 3 and len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert trainer._last_loaded_step == 2  # TRL synced before the samples of steps 2 and 3

    # After a sync, vLLM scores the student's reply as the trained student does, not as the starting model. vLLM's
    # CPU kernels round differently, so the gap to the student is small, not zero; the start sits far further off.
    to_student, to_start = sync_gaps(trainer, tokenizer, examples[0]["prompt"], 16)
    assert to_student < 0.01 and to_start > 10 * to_student, (to_student, to_start)
