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
from dataclasses import asdict
from pathlib import Path

import torch
import yaml
from transformers import AutoTokenizer

from redumix.common.files import atomic_write_text, read_text
from redumix.common.ranks import print0
from redumix.data.tasks import TaskConfig, flat_settings
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
    decisive = build_settings(settings, task, seed)
    episodes = corpus_episodes(task.arith, settings.corpus, seed)
    sample = list(itertools.islice(episodes, TOKENIZER_EPISODES))
    if (out_dir / "tokenizer.json").is_file() and read_text_or_none(out_dir / "build_config.yaml") == decisive:
        tokenizer = AutoTokenizer.from_pretrained(out_dir)  # the one this build trained before it stopped
    else:
        shutil.rmtree(out_dir, ignore_errors=True)
        out_dir.mkdir(parents=True)
        tokenizer = corpus_tokenizer(sample, settings.vocab_size)
        tokenizer.save_pretrained(out_dir)
        atomic_write_text(out_dir / "build_config.yaml", decisive)
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


# Settings that change neither the weights nor metrics.json: a shipped build made with other values still applies.
_NOT_DECISIVE = ("threads", "checkpoint_steps", "eval_batch_size", "shipped")


def build_settings(settings: EmbeddedConfig, task: TaskConfig, seed: int) -> str:
    """What decides the built model (its `build_config.yaml`): a build is resumed or reused only when these match.

    The section is one flat mapping under the key `base`, the corpus keys in the place of `corpus`: the layout and
    the key that builds were written with before the corpus had its own section and the section its own name, so
    the shipped build's file stays a match.
    """
    base = {}
    for name, value in asdict(settings).items():
        if name == "corpus":
            base.update(value)
        elif name not in _NOT_DECISIVE:
            base[name] = value
    return yaml.safe_dump({"seed": seed, "base": base, "task": flat_settings(task)}, sort_keys=False)
