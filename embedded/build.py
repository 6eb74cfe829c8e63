"""Building the embedded default model: a tiny Llama trained from scratch on arith text. A library: it takes the
narrow settings it needs (the `embedded` section, the task's settings, a seed, folders) and imports nothing from
pipeline/; the `embedded` stage (pipeline/embedded_stage.py) calls it.

What a build does, top to bottom:
1. Generates the corpus (embedded/corpus.py) on arith problems outside the test and train buckets.
2. Trains the tokenizer on its first episodes (embedded/tokenizer.py).
3. Pre-trains a tiny Llama from scratch on packed rows for `embedded.steps` steps (embedded/pretrain.py).
4. Measures it on held-out `test` problems (embedded/measure.py).

The tokenizer is saved first and the training loop checkpoints into `OUT/checkpoint/`, so a build resumed after a
crash ends with the same weights as an unbroken one.
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import AutoTokenizer

from redumix.common.files import atomic_write_text, read_text
from redumix.common.fingerprints import RECORD_VERSION, build_record_v0
from redumix.common.ranks import print0
from redumix.data.tasks import TaskConfig, task_record
from redumix.embedded.config import EmbeddedConfig
from redumix.embedded.corpus import corpus_episodes
from redumix.embedded.pretrain import build_model, build_rows, train_model
from redumix.embedded.tokenizer import corpus_tokenizer

TOKENIZER_EPISODES = 3000  # the corpus's first episodes, which the tokenizer is trained on


def require_arith(task: TaskConfig) -> None:
    """The embedded model is an arith model: its corpus and its measures are arith's, and no other task has them."""
    if task.name != "arith":
        raise ValueError(
            f"task.name={task.name!r} has no training text for the embedded model; build it with "
            "task.name=arith in another run folder, or set model.path to a local checkpoint"
        )


# --- building -------------------------------------------------------------------------------------------------------


def build_embedded(
    settings: EmbeddedConfig, task: TaskConfig, seed: int, out_dir: Path, metrics: Path | None = None
) -> dict:
    """Tokenizer, corpus, model and training into `out_dir` (no metrics.json). Returns build statistics; with
    `metrics` (a metrics.jsonl file), the training loss is logged there as it goes.

    Resumes a build that `out_dir` holds from an earlier run of the same settings (its tokenizer and checkpoint).
    """
    torch.set_num_threads(settings.threads)
    episodes = corpus_episodes(task.arith, settings.corpus, seed)
    sample = list(itertools.islice(episodes, TOKENIZER_EPISODES))
    if (out_dir / "tokenizer.json").is_file() and built_with(out_dir, settings, task, seed):
        tokenizer = AutoTokenizer.from_pretrained(out_dir)  # the one this build trained before it stopped
    else:
        shutil.rmtree(out_dir, ignore_errors=True)
        out_dir.mkdir(parents=True)
        tokenizer = corpus_tokenizer(sample, settings.vocab_size)
        tokenizer.save_pretrained(out_dir)
    # Written again on a resume: a version 0 file that matched becomes version 1.
    atomic_write_text(out_dir / BUILD_CONFIG, build_config_text(settings, task, seed))
    n_rows = settings.steps * settings.batch_rows
    *rows, counts = build_rows(tokenizer, itertools.chain(sample, episodes), n_rows, settings.seq_len)
    model = build_model(settings, tokenizer, seed)
    params = sum(p.numel() for p in model.parameters())
    print0(f"embedded: {params / 1e6:.2f}M parameters, vocab {len(tokenizer)}, {counts['episodes']} episodes packed "
           f"into {n_rows} rows of {settings.seq_len} ({(rows[1] != -100).float().mean():.0%} of tokens trained)")
    stats = train_model(model, rows, settings, metrics, checkpoint=out_dir / "checkpoint")
    model.save_pretrained(out_dir, safe_serialization=True)
    shutil.rmtree(out_dir / "checkpoint", ignore_errors=True)
    return {"parameters": params, "vocab_size": len(tokenizer), **counts, **stats}


def read_text_or_none(path: Path) -> str | None:
    return read_text(path) if path.is_file() else None


# --- what decides a build -------------------------------------------------------------------------------------------

BUILD_CONFIG = "build_config.yaml"  # a build's record, beside its weights


def build_record(settings: EmbeddedConfig, task: TaskConfig, seed: int) -> dict[str, Any]:
    """What decides the built model and its metrics.json, in the record's own names (common/fingerprints.py): not
    `threads`, `checkpoint_steps`, `eval_batch_size` or `shipped`, which change neither."""
    s, c = settings, settings.corpus
    return {
        "seed": seed,
        "model": {"steps": s.steps, "batch_rows": s.batch_rows, "seq_len": s.seq_len, "vocab_size": s.vocab_size,
                  "hidden_size": s.hidden_size, "layers": s.layers, "heads": s.heads,
                  "intermediate_size": s.intermediate_size, "lr": s.lr, "min_lr_ratio": s.min_lr_ratio,
                  "warmup_steps": s.warmup_steps, "weight_decay": s.weight_decay, "bf16": s.bf16},
        "corpus": {"mix_solution": c.mix_solution, "mix_reflection": c.mix_reflection, "mix_critique": c.mix_critique,
                   "mix_refine": c.mix_refine, "mix_longhand": c.mix_longhand, "slip_rate": c.slip_rate,
                   "wrong_attempt_rate": c.wrong_attempt_rate, "noisy_feedback_rate": c.noisy_feedback_rate,
                   "check_span_rate": c.check_span_rate},
        "measure": {"eval_n": s.eval_n, "eval_reflection": s.eval_reflection},
        "task": task_record(task),
    }


def build_config_text(settings: EmbeddedConfig, task: TaskConfig, seed: int) -> str:
    """A build's `build_config.yaml`: its record, under its version."""
    record = build_record(settings, task, seed)
    return yaml.safe_dump({"version": RECORD_VERSION, **record}, sort_keys=False)


def stored_build_record(folder: Path) -> dict[str, Any] | None:
    """The record a build folder's `build_config.yaml` holds (a version 0 file read into version 1), or None."""
    text = read_text_or_none(Path(folder) / BUILD_CONFIG)
    stored = yaml.safe_load(text) if text else None
    if not isinstance(stored, dict):
        return None
    if "version" not in stored:
        try:
            return build_record_v0(stored)
        except (KeyError, TypeError):  # not a build's record of any version
            return None
    if stored.pop("version") != RECORD_VERSION:
        return None
    return stored


def built_with(folder: Path, settings: EmbeddedConfig, task: TaskConfig, seed: int) -> bool:
    """Whether the build in `folder` was made from exactly these settings."""
    return stored_build_record(folder) == build_record(settings, task, seed)
