"""Ready for GPUs, checked without one: SDPA attention where the architecture has it, and the bf16 recipe path
(bf16 weights decode; bf16 autocast trains a step) on CPU."""

from __future__ import annotations

from pathlib import Path

import torch

from redumix.data.tasks import make_task
from redumix.generate.hf_engine import HfEngine
from redumix.generate.model_io import ModelConfig, load_model
from redumix.pipeline.config import load_config
from redumix.pipeline.decoders import make_decoder
from redumix.pipeline.run import RunDir
from redumix.pipeline.train import run_train
from tests.train_fixtures import write_base, write_harvest

ROOT = Path(__file__).resolve().parents[1]


def test_models_load_with_sdpa_attention(tiny_model_dir, tmp_path):
    for folder in (tiny_model_dir, write_base(tmp_path / "llama")):
        model, _ = load_model(folder)
        assert model.config._attn_implementation == "sdpa"


def test_bf16_weights_decode_with_every_token_level_family(tiny_model_dir):
    config = load_config(ROOT / "recipes" / "tiny.yaml", [
        f"model.path={tiny_model_dir}", "model.dtype=bfloat16", "sampling.max_new_tokens=5",
        "redumix.reflection_max_tokens=4", "redumix.critique_max_tokens=3", "reflective.trigger_after=[]",
    ])
    model, tokenizer = load_model(tiny_model_dir, ModelConfig(dtype="bfloat16"))
    assert next(model.parameters()).dtype == torch.bfloat16
    task = make_task(config.task, config.seed)
    examples = task.examples("test", 2)
    for name in ("greedy", "redumix-oracle", "moi", "reflective"):
        outputs = make_decoder(config, name, {})(HfEngine(model, tokenizer), examples, task)
        assert len(outputs) == 2 and all(o.usage.fpe > 0 and o.token_ids for o in outputs), name


def test_bf16_recipe_trains_a_step_on_cpu(tmp_path):
    run = RunDir(tmp_path / "run")
    write_base(run.embedded)
    write_harvest(run.harvest, n_rows=8, length=8)
    config = load_config(None, [f"model.path={run.embedded}", "train.bf16=true", "train.max_steps=1",
                                "train.batch_size=4", "train.heldout_fraction=0.25", "train.save_steps=1"])
    result = run_train(config, run)
    assert result["steps"] == 1 and torch.isfinite(torch.tensor(result["final_loss"]))
