"""The MBPP recipe on the real Qwen2.5-Coder-0.5B weights (`make qwen-coder-0.5b`) through harvest, train and eval at
a few rows: the `code` task's feedback reaches x2 from the sandbox, the stored targets of a 151,936-id vocabulary make
a distribution, and the records grade as the task grades them. (The one pipeline run on these weights: the GSM8K recipe
is the same code on another task; tests/test_qwen_coder.py checks the checkpoint itself.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from redumix.data.code import CodeTask
from redumix.data.shards import iter_rows, shard_paths
from redumix.data.task import Example
from redumix.pipeline.config import load_config
from redumix.pipeline.eval import run_eval
from redumix.pipeline.harvest import run_harvest
from redumix.pipeline.run import RunDir
from redumix.pipeline.train import run_train

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "qwen2.5-coder-0.5b-mbpp.yaml"
FOLDER = ROOT / "models" / "qwen2.5-coder-0.5b-instruct"
MBPP = ROOT.parent / "shared" / "data" / "mbpp" / "mbpp.jsonl"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (FOLDER / "config.json").is_file(),
                       reason=f"no {FOLDER.relative_to(ROOT)}: run `make qwen-coder-0.5b` first"),
    pytest.mark.skipif(not MBPP.is_file(), reason=f"MBPP is read from {MBPP}, which is absent"),
]


def test_the_mbpp_recipe_runs_harvest_train_and_eval(tmp_path):
    config = load_config(RECIPE, [
        f"task.code.mbpp_path={MBPP}", "harvest.n=2", "harvest.batch_size=2", "harvest.shard_rows=2",
        "sampling.max_new_tokens=64", "redumix.reflection_max_tokens=16", "redumix.critique_max_tokens=8",
        "train.max_steps=1", "train.save_steps=1", "train.heldout_fraction=0.5", "train.batch_size=1",
        "eval.n=1", "eval.n_other=1", "eval.batch_size=1", "eval.decoders=[greedy, redumix-oracle]",
        "eval.tuned_decoders=[greedy]",
    ])
    task = CodeTask(config.task.code, prompt_suffix=config.task.prompt_suffix)
    run = RunDir(tmp_path / "run")
    run_harvest(config, run)
    rows = list(iter_rows(shard_paths(run.harvest)))
    assert [row["id"] for row in rows] == [f"mbpp-{i}" for i in range(511, 513)]
    for row in rows:
        example = Example(row["id"], "code", row["prompt"], row["reference"])
        assert row["feedback"] == task.feedback(row["original"], example)  # the sandbox's words, in x2
        assert row["original_correct"] == task.is_correct(row["original"], example)
        assert len(row["mix_topk_ids"]) == len(row["redo_token_ids"]) > 0
        # the stored targets of a 151,936-id vocabulary: top-k ids in range, top-k and tail a distribution
        assert all(len(ids) == config.redumix.topk and max(ids) < 151936 for ids in row["mix_topk_ids"])
        assert all(-30 < lps[0] <= 0 for lps in row["mix_topk_logprobs"])  # float32 maths stored as float16
        mass = [math.fsum(math.exp(lp) for lp in lps) + math.exp(tail)
                for lps, tail in zip(row["mix_topk_logprobs"], row["mix_tail_logprob"], strict=True)]
        assert all(abs(m - 1) < 0.01 for m in mass)
    assert json.loads((run.harvest / "manifest.json").read_text())["grader"] == task.grader()
    trained = run_train(config, run)
    assert trained["steps"] == 1 and math.isfinite(trained["final_loss"])
    run_eval(config, run)
    report = json.loads((run.eval / "report.json").read_text())
    assert report["grader"] == task.grader()
    assert {(r["checkpoint"], r["decoder"]) for r in report["rows"]} == {
        ("base", "greedy"), ("base", "redumix-oracle"), ("tuned", "greedy")}
    for path in (run.eval / "generations").glob("*.jsonl"):
        for record in map(json.loads, path.read_text().splitlines()):
            assert "<|im_end|>" not in record["output"] and "<|im_start|>" not in record["output"]  # stops at ChatML's
            example = Example(record["id"], "code", record["prompt"], record["reference"])
            assert record["correct"] == task.is_correct(record["output"], example)
