"""`redumix embedded` (embedded/): the tokenizer, the chat template's token-concatenativity, packing, measuring, and a
tiny end-to-end build."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from redumix.data.arith import ArithConfig
from redumix.data.chat import prompt_ids, template_pieces
from redumix.data.prompts import critique_messages, redo_messages, refine_messages
from redumix.data.tasks import make_task
from redumix.embedded import pretrain
from redumix.embedded.build import TOKENIZER_EPISODES, build_config_text
from redumix.embedded.corpus import CorpusSpec, corpus_episodes
from redumix.embedded.measure import measure
from redumix.embedded.pretrain import encode_episodes, pack_rows
from redumix.embedded.tokenizer import corpus_tokenizer, episode_texts, train_tokenizer
from redumix.embedded.vocab import ASSISTANT, END, REFLECT_CLOSE, REFLECT_OPEN, USER
from redumix.pipeline.config import load_config
from redumix.pipeline.embedded_stage import (
    embedded_is_complete,
    ensure_embedded,
    run_embedded,
    shipped_embedded,
)
from redumix.pipeline.resolve import ConfigError
from redumix.pipeline.run import RunDir
from tests.conftest import kill_when

CONVERSATION = redo_messages(
    "Ava has 23 apples. She buys 17 more. How many apples does Ava have now?",
    "23 + 17 = 41\nThe answer is 41.",
    "Your final answer 41 is wrong.",
    "I check each line the long way.\nLine 1: 23 + 17: 20 + 10 = 30, 3 + 7 = 10, 30 + 10 = 40. Wrong, I wrote 41.",
)


@pytest.fixture(scope="module")
def episodes():
    return list(itertools.islice(corpus_episodes(ArithConfig(), CorpusSpec(check_span_rate=0.3), seed=0), 600))


@pytest.fixture(scope="module")
def tokenizer(episodes, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    train_tokenizer(episode_texts(episodes), vocab_size=400).save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)  # what every later stage loads


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_tokenizer_round_trips_and_splits_digits(tokenizer):
    assert len(tokenizer) == 400
    for text in ["54 * 3 = 162\nThe answer is 162.", "Zoë paid $1,234.50 — ok?", CONVERSATION[3]["content"]]:
        assert tokenizer.decode(ids(tokenizer, text)) == text
    pieces = [tokenizer.decode([t]) for t in ids(tokenizer, "has 9876543210 apples")]
    assert "".join(pieces[pieces.index("9") : pieces.index("0") + 1]) == "9876543210"
    assert all(len(p) == 1 for p in pieces[pieces.index("9") : pieces.index("0") + 1])
    for token in (END, USER, ASSISTANT, REFLECT_OPEN, REFLECT_CLOSE, tokenizer.pad_token):
        assert len(ids(tokenizer, token)) == 1
    assert tokenizer.eos_token == END and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.bos_token is None  # nothing is prepended, so pieces concatenate


def test_chat_template_renders_the_pipeline_turns(tokenizer):
    text = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    expected = "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in CONVERSATION) + ASSISTANT
    assert text == expected
    plain = tokenizer.apply_chat_template(CONVERSATION[:1], tokenize=False)
    assert plain == f"{USER}{CONVERSATION[0]['content']}{END}"
    for messages in (critique_messages("Q?", "1 + 1 = 2\nThe answer is 2."), refine_messages("Q?", "Solution 1:\nx")):
        assert tokenizer.apply_chat_template(messages, tokenize=False).count(END) == len(messages)


def test_chat_template_is_token_concatenative(tokenizer):
    """x2's ids = x's ids + y1's ids + the later turns' ids, however each piece was tokenized."""
    full = prompt_ids(tokenizer, CONVERSATION)
    for k in range(1, len(CONVERSATION) + 1):
        prefix = ids(tokenizer, tokenizer.apply_chat_template(CONVERSATION[:k], tokenize=False))
        assert full[: len(prefix)] == prefix
    pieces = template_pieces(tokenizer, CONVERSATION)
    turns = [ids(tokenizer, m["content"]) for m in CONVERSATION if m["role"] == "assistant"]
    rebuilt = pieces[0] + turns[0] + pieces[1] + turns[1] + pieces[2]
    assert rebuilt == full
    # generated ids that are not the canonical tokenization still splice in cleanly at turn boundaries
    odd = [tokenizer.convert_tokens_to_ids(t) for t in tokenizer.convert_ids_to_tokens(turns[0])]
    assert pieces[0] + odd + pieces[1] == full[: len(pieces[0] + odd + pieces[1])]


def test_encoded_episodes_match_the_template_and_mask_the_reflect_marker(tokenizer, episodes):
    docs = encode_episodes(tokenizer, episodes)
    open_id = tokenizer.convert_tokens_to_ids(REFLECT_OPEN)
    close_id = tokenizer.convert_tokens_to_ids(REFLECT_CLOSE)
    saw_span = False
    for episode, (doc_ids, trained) in zip(episodes, docs, strict=True):
        assert doc_ids.tolist() == ids(tokenizer, tokenizer.apply_chat_template(episode.messages, tokenize=False))
        assert not trained[doc_ids == open_id].any()
        if (doc_ids == open_id).any():
            saw_span = True
            assert trained[doc_ids == close_id].all()  # the model learns to close a span and what follows
        # every target sits in a trained assistant turn, and ends with that turn's <|end|>
        end_id = tokenizer.convert_tokens_to_ids(END)
        assert doc_ids[trained][-1] == end_id
    assert saw_span
    input_ids, labels, positions = pack_rows(docs, 1024, tokenizer.pad_token_id)  # room for the longest refine
    total = sum(len(d) for d, _ in docs)
    assert int((input_ids != tokenizer.pad_token_id).sum()) == total  # nothing dropped, nothing cut
    assert int((labels != -100).sum()) == sum(int(t.sum()) for _, t in docs)
    assert input_ids.shape[1] == 1024 and len(input_ids) < len(docs)
    starts = (input_ids == tokenizer.convert_tokens_to_ids(USER)).sum()
    assert starts >= len(docs)  # whole episodes: each still opens with its user turn


def test_tiny_base_builds_end_to_end_and_is_skipped_after(tmp_path, capsys):
    overrides = [
        "embedded.steps=3", "embedded.batch_rows=2", "embedded.hidden_size=32", "embedded.layers=2",
        "embedded.heads=2",
        "embedded.intermediate_size=64", "embedded.vocab_size=320", "embedded.eval_n=3", "embedded.eval_batch_size=3",
        "embedded.threads=1", "embedded.warmup_steps=1",
    ]
    config = load_config("recipes/tiny.yaml", overrides)
    run = RunDir(tmp_path / "run")
    run_embedded(config, run)
    assert embedded_is_complete(run)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "build_config.yaml"):
        assert (run.embedded / name).is_file(), name
    assert not list(run.root.glob(".embedded.tmp-*"))
    model = AutoModelForCausalLM.from_pretrained(run.embedded)
    tokenizer = AutoTokenizer.from_pretrained(run.embedded)
    assert model.config.model_type == "llama" and model.config.vocab_size == len(tokenizer) == 320
    assert model.config.hidden_size == 32 and model.generation_config.eos_token_id == tokenizer.eos_token_id
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids(tokenizer, CONVERSATION)])).logits
    assert torch.isfinite(logits).all()
    metrics = json.loads((run.embedded / "metrics.json").read_text())
    assert metrics["n"] == 3 and 0 <= metrics["accuracy"] <= 1
    assert {"original_accuracy", "redo_accuracy", "fixed", "broken"} <= set(metrics["reflection_verifier"])
    assert "critique_verdict_accuracy" in metrics["reflection_self"]
    assert {"accuracy", "line_accuracy"} == set(metrics["forced_check_spans"])
    assert metrics["build"]["steps_per_s"] > 0 and metrics["build"]["parameters"] == model.num_parameters()
    logged = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    assert any(line["stage"] == "embedded" and "loss" in line for line in logged)
    assert any(line["stage"] == "embedded" and "accuracy" in line for line in logged)

    stamp = (run.embedded / "metrics.json").stat().st_mtime_ns
    capsys.readouterr()
    run_embedded(config, run)
    assert "complete" in capsys.readouterr().out
    assert (run.embedded / "metrics.json").stat().st_mtime_ns == stamp

    # A crash after training but before the marker: the rerun evaluates the saved model instead of training.
    weights = (run.embedded / "model.safetensors").stat().st_mtime_ns
    (run.embedded / "metrics.json").unlink()
    run_embedded(config, run)
    assert "without metrics" in capsys.readouterr().out
    assert embedded_is_complete(run) and (run.embedded / "model.safetensors").stat().st_mtime_ns == weights


RESUMABLE = [
    "embedded.steps=12", "embedded.checkpoint_steps=4", "embedded.batch_rows=2", "embedded.hidden_size=32",
    "embedded.layers=2", "embedded.heads=2", "embedded.intermediate_size=64", "embedded.vocab_size=320",
    "embedded.eval_n=2", "embedded.eval_batch_size=2",
    "embedded.threads=1", "embedded.warmup_steps=1", "embedded.eval_reflection=false",
]


def _weights(run: RunDir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run.embedded / "model.safetensors")


def test_an_interrupted_base_build_resumes_to_the_same_weights(tmp_path, monkeypatch, capsys):
    config = load_config("recipes/tiny.yaml", RESUMABLE)
    whole = RunDir(tmp_path / "whole")
    run_embedded(config, whole)

    real_lr_at = pretrain.lr_at

    def crash_at_step_9(step, settings):
        if step == 9:
            raise KeyboardInterrupt("killed")
        return real_lr_at(step, settings)

    broken = RunDir(tmp_path / "broken")
    monkeypatch.setattr(pretrain, "lr_at", crash_at_step_9)
    with pytest.raises(KeyboardInterrupt):
        run_embedded(config, broken)
    state = json.loads((broken.root / ".embedded.partial" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 8 and not embedded_is_complete(broken)
    monkeypatch.setattr(pretrain, "lr_at", real_lr_at)
    capsys.readouterr()
    run_embedded(config, broken)
    assert "resuming from step 8" in capsys.readouterr().out
    assert not (broken.root / ".embedded.partial").exists() and not (broken.embedded / "checkpoint").exists()
    expected, resumed = _weights(whole), _weights(broken)
    assert expected.keys() == resumed.keys()
    assert all(torch.equal(expected[k], resumed[k]) for k in expected)


def test_a_partial_build_of_other_settings_is_not_resumed(tmp_path, capsys):
    config = load_config("recipes/tiny.yaml", RESUMABLE)
    run = RunDir(tmp_path)
    partial = run.root / ".embedded.partial"
    (partial / "checkpoint").mkdir(parents=True)
    (partial / "build_config.yaml").write_text("seed: 99\n")
    (partial / "tokenizer.json").write_text("{}")
    (partial / "checkpoint" / "state.json").write_text('{"step": 8}')
    run_embedded(config, run)
    assert "resuming" not in capsys.readouterr().out and embedded_is_complete(run)


@pytest.mark.slow
def test_a_killed_base_build_resumes_to_the_same_weights(tmp_path):
    """SIGKILL the real CLI once a checkpoint exists; the rerun ends with the weights of an unbroken build."""
    import subprocess
    import sys

    overrides = [o.replace("embedded.steps=12", "embedded.steps=60")
                 .replace("checkpoint_steps=4", "checkpoint_steps=10") for o in RESUMABLE]
    whole = RunDir(tmp_path / "whole")
    run_embedded(load_config("recipes/tiny.yaml", overrides), whole)
    command = [sys.executable, "-m", "redumix.pipeline.cli", "embedded", "--recipe", "recipes/tiny.yaml",
               "--run-dir", str(tmp_path / "killed"), *overrides]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state = tmp_path / "killed" / ".embedded.partial" / "checkpoint" / "state.json"
    kill_when(process, state.exists)  # the first checkpoint of six
    killed = RunDir(tmp_path / "killed")
    run_embedded(load_config("recipes/tiny.yaml", overrides), killed)
    expected, resumed = _weights(whole), _weights(killed)
    assert all(torch.equal(expected[k], resumed[k]) for k in expected)


def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_a_shipped_build_of_the_same_settings_is_copied_and_any_other_is_rebuilt(tmp_path, capsys):
    shipped = RunDir(tmp_path / "maker")
    run_embedded(load_config("recipes/tiny.yaml", RESUMABLE), shipped)
    same = load_config("recipes/tiny.yaml", [*RESUMABLE, f"embedded.shipped={shipped.embedded}", "embedded.threads=2"])
    capsys.readouterr()

    copied = RunDir(tmp_path / "copied")
    ensure_embedded(same, copied)
    out = capsys.readouterr().out
    assert "copied the shipped build" in out and "parameters" not in out  # no build ran
    assert _files(copied.embedded) == _files(shipped.embedded) and embedded_is_complete(copied)
    assert not (copied.root / ".embedded.shipped.partial").exists()

    other = load_config("recipes/tiny.yaml", [*RESUMABLE, f"embedded.shipped={shipped.embedded}", "embedded.lr=0.002"])
    rebuilt = RunDir(tmp_path / "rebuilt")
    ensure_embedded(other, rebuilt)
    out = capsys.readouterr().out
    assert "made with other settings" in out and "parameters" in out and embedded_is_complete(rebuilt)
    assert _files(rebuilt.embedded)["model.safetensors"] != _files(shipped.embedded)["model.safetensors"]

    built = RunDir(tmp_path / "built")  # `redumix embedded` always builds from the code
    run_embedded(same, built)
    out = capsys.readouterr().out
    assert "copied" not in out and "parameters" in out and embedded_is_complete(built)


def test_the_tiny_recipe_uses_the_shipped_build():
    """The shipped build must match the recipe's settings, or every fresh clone builds the base itself, which takes
    longer than the pipeline's budget for it (docs/measurements.md, "Building the embedded base")."""
    config = load_config("recipes/tiny.yaml")
    folder = shipped_embedded(config)
    assert folder is not None, "models/tiny-base does not match recipes/tiny.yaml: rebuild it (see docs/design.md)"
    # In the current record version: the shipped file is migrated in the repository, not on every run.
    assert build_config_text(config.embedded, config.task, config.seed) == (folder / "build_config.yaml").read_text()
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["build"]["parameters"] == 516_960 and metrics["n"] == config.embedded.eval_n
    assert sum(p.stat().st_size for p in folder.iterdir()) < 20e6


def test_the_tiny_recipe_corpus_trains_the_shipped_tokenizer(tmp_path):
    """The corpus is the shipped build's, byte for byte: its first episodes train exactly the shipped tokenizer (BPE
    merges follow the counts of every piece of text, so a changed episode shows)."""
    config = load_config("recipes/tiny.yaml")
    episodes = corpus_episodes(config.task.arith, config.embedded.corpus, config.seed)
    episodes = itertools.islice(episodes, TOKENIZER_EPISODES)
    corpus_tokenizer(list(episodes), config.embedded.vocab_size).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / name).read_bytes() == (Path(config.embedded.shipped) / name).read_bytes(), name


def test_corpus_settings_live_under_embedded_corpus_and_are_checked():
    config = load_config("recipes/tiny.yaml", ["embedded.corpus.check_span_rate=0.3"])
    assert config.embedded.corpus.check_span_rate == 0.3 and config.embedded.corpus.wrong_attempt_rate == 0.6
    settings = build_config_text(config.embedded, config.task, config.seed)
    tiny = load_config("recipes/tiny.yaml")
    assert "  check_span_rate: 0.3\n" in settings
    assert settings != build_config_text(tiny.embedded, tiny.task, tiny.seed)
    with pytest.raises(ConfigError, match=r"'embedded.corpus.slip_rate': slip_rate must be in \[0, 1\]"):
        load_config("recipes/tiny.yaml", ["embedded.corpus.slip_rate=2"])
    no_mix = [f"embedded.corpus.mix_{kind}=0" for kind in ("solution", "reflection", "critique", "refine", "longhand")]
    with pytest.raises(ConfigError, match="positive sum"):
        load_config("recipes/tiny.yaml", no_mix)


def _shipped_metrics_measured(overrides: list[str]) -> tuple[dict, dict]:
    """(what `measure` gives the shipped model now, what its build recorded in metrics.json)."""
    config = load_config("recipes/tiny.yaml", overrides)
    folder = Path(config.embedded.shipped)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    measured = measure(model, tokenizer, make_task(config.task, config.seed), config.embedded, config.seed)
    return measured, json.loads((folder / "metrics.json").read_text())


# Another CPU's float rounding may flip a near-tie between two greedy tokens: one problem's worth of slack.
ONE_PROBLEM = 1 / 300 + 1e-9


def test_measuring_the_shipped_base_reproduces_its_greedy_metrics():
    """generate/'s greedy decoder scores the shipped model as its build did (on HF generate, before embedded/)."""
    measured, shipped = _shipped_metrics_measured(["embedded.eval_reflection=false"])
    assert set(measured) == {"n", "accuracy", "no_answer", "line_accuracy"} and measured["n"] == shipped["n"] == 300
    assert abs(measured["accuracy"] - shipped["accuracy"]) <= ONE_PROBLEM
    assert abs(measured["no_answer"] - shipped["no_answer"]) <= 1
    assert abs(measured["line_accuracy"] - shipped["line_accuracy"]) <= 0.01


@pytest.mark.slow
def test_measuring_the_shipped_base_reproduces_its_reflection_metrics():
    """ReDuMix at λ=0 gives the redo accuracies, fixed and broken counts and critique verdicts the build recorded.
    Forced check spans are compared on accuracy only: the reflective decoder goes on after a span the model does not
    close, where the build's decoding stopped, so their visible lines differ (line accuracy 0.90 against 0.92)."""
    measured, shipped = _shipped_metrics_measured([])
    for feedback in ("reflection_verifier", "reflection_self"):
        assert measured[feedback].keys() == shipped[feedback].keys()
        for key, value in shipped[feedback].items():
            slack = 1 if key in ("fixed", "broken") else ONE_PROBLEM
            assert abs(measured[feedback][key] - value) <= slack, (feedback, key, measured[feedback][key], value)
    assert abs(measured["forced_check_spans"]["accuracy"] - shipped["forced_check_spans"]["accuracy"]) <= ONE_PROBLEM


# Builds of the tiny recipe: (greedy accuracy, x2-only redo accuracy after verifier feedback) on its 300 held-out
# problems. The trained weights depend on the CPU's float rounding, so each host's build of a seed is one more draw.
BUILD_DRAWS = {
    "seed 0 on the host that built models/tiny-base": (0.42, 0.8533),
    "seed 0 on an AMD EPYC host, at 1 and at 2 threads alike": (0.2967, 0.7033),
    "seed 1 on the AMD EPYC host": (0.1867, 0.42),
    "seed 2 on the AMD EPYC host": (0.3033, 0.60),
}


def _below_lowest_draw(values: list[float], n: int = 300) -> float:
    """The lowest draw less three binomial standard deviations at n problems."""
    low = min(values)
    return low - 3 * math.sqrt(low * (1 - low) / n)


@pytest.mark.slow
def test_the_base_rebuilt_from_the_code_matches_the_shipped_one(tmp_path):
    """A whole base build: `redumix embedded` on the tiny recipe against models/tiny-base.

    What no CPU changes must be equal byte for byte: the build settings, the tokenizer, the corpus (episodes and
    packed rows) and the parameter count. The trained weights are not: 3,500 float32 steps turn another CPU's
    rounding into another model (far apart from the shipped weights: docs/measurements.md, "Building the embedded
    base"), so a rebuild on another host is one more draw of the build, like another seed (BUILD_DRAWS: 0.19 to
    0.42). The accuracy and the redo's gain are checked against the lowest draw, less three binomial standard
    deviations: a model that solves problems, and reflection after verifier feedback that fixes far more answers
    than it breaks."""
    config = load_config("recipes/tiny.yaml")
    run = RunDir(tmp_path)
    run_embedded(config, run)
    shipped_folder = Path(config.embedded.shipped)
    shipped, rebuilt = (json.loads((folder / "metrics.json").read_text()) for folder in (shipped_folder, run.embedded))
    for name in ("build_config.yaml", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (run.embedded / name).read_bytes() == (shipped_folder / name).read_bytes(), name
    for key in ("parameters", "vocab_size", "episodes", "rows"):
        assert rebuilt["build"][key] == shipped["build"][key], key
    assert rebuilt["n"] == shipped["n"] == 300
    draws = list(BUILD_DRAWS.values())
    assert rebuilt["accuracy"] >= _below_lowest_draw([accuracy for accuracy, _ in draws]), rebuilt
    verifier = rebuilt["reflection_verifier"]
    gain = verifier["redo_accuracy"] - verifier["original_accuracy"]
    assert gain >= _below_lowest_draw([redo - accuracy for accuracy, redo in draws]), verifier
    assert verifier["fixed"] >= 5 * verifier["broken"], verifier  # the draws: 14 to 44 times
