"""`redumix base`: build the embedded default model into RUN_DIR/base, or reuse the shipped build.

What a build does, top to bottom:
1. Generates the corpus (embedded/corpus.py) on arith problems outside the test and train buckets.
2. Trains the tokenizer on its first episodes (embedded/tokenizer.py).
3. Pre-trains a tiny Llama from scratch on packed rows for `base.steps` steps (embedded/pretrain.py).
4. Measures it on held-out `test` problems (embedded/measure.py).

Files appear atomically: the model is built in `.base.partial/` and renamed to `base/`, and `base/metrics.json`,
the completion marker, is written last. The tokenizer is saved first and the training loop checkpoints into
`.base.partial/checkpoint/`, so a rerun after a crash resumes from there and ends with the same weights as an
unbroken run. If `base/` holds a model but no metrics (a crash during measuring), the rerun measures that model.

`ensure_base` is what the other stages call: the embedded default on first use, copied from `base.shipped` when that
build was made from exactly this recipe's settings (`build_settings`), else built from the code.
"""

from __future__ import annotations

import itertools
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from redumix.common.files import atomic_write_json, atomic_write_text, log_metrics, read_json, read_text
from redumix.common.ranks import barrier, print0, rank
from redumix.data.tasks import flat_settings, make_task
from redumix.embedded.corpus import corpus_episodes
from redumix.embedded.measure import measure
from redumix.embedded.pretrain import build_model, build_rows, train_model
from redumix.embedded.tokenizer import corpus_tokenizer
from redumix.pipeline.config import REPO, Config
from redumix.pipeline.run import RunDir

TOKENIZER_EPISODES = 3000  # the corpus's first episodes, which the tokenizer is trained on


def base_is_complete(run: RunDir) -> bool:
    return (run.base / "metrics.json").is_file()


def require_arith(config: Config) -> None:
    """The embedded base is an arith model: its corpus and its measures are arith's, and no other task has them."""
    if config.task.name != "arith":
        raise ValueError(
            f"task.name={config.task.name!r} has no training text for the embedded base; build the base with "
            "task.name=arith in another run folder, or set model.path to a local checkpoint"
        )


# --- building -------------------------------------------------------------------------------------------------------


def build_base(config: Config, out_dir: Path, run: RunDir | None = None) -> dict:
    """Tokenizer, corpus, model and training into `out_dir` (no metrics). Returns build statistics.

    Resumes a build that `out_dir` holds from an earlier run of the same settings (its tokenizer and checkpoint).
    """
    base = config.base
    torch.set_num_threads(base.threads)
    settings = build_settings(config)
    episodes = corpus_episodes(config.task.arith, base.corpus, config.seed)
    sample = list(itertools.islice(episodes, TOKENIZER_EPISODES))
    if (out_dir / "tokenizer.json").is_file() and _read_text(out_dir / "build_config.yaml") == settings:
        tokenizer = AutoTokenizer.from_pretrained(out_dir)  # the one this build trained before it stopped
    else:
        shutil.rmtree(out_dir, ignore_errors=True)
        out_dir.mkdir(parents=True)
        tokenizer = corpus_tokenizer(sample, base.vocab_size)
        tokenizer.save_pretrained(out_dir)
        atomic_write_text(out_dir / "build_config.yaml", settings)
    n_rows = base.steps * base.batch_rows
    *rows, counts = build_rows(tokenizer, itertools.chain(sample, episodes), n_rows, base.seq_len)
    model = build_model(base, tokenizer, config.seed)
    params = sum(p.numel() for p in model.parameters())
    print0(f"base: {params / 1e6:.2f}M parameters, vocab {len(tokenizer)}, {counts['episodes']} episodes packed "
           f"into {n_rows} rows of {base.seq_len} ({(rows[1] != -100).float().mean():.0%} of tokens trained)")
    stats = train_model(model, rows, base, run, checkpoint=out_dir / "checkpoint")
    model.save_pretrained(out_dir, safe_serialization=True)
    shutil.rmtree(out_dir / "checkpoint", ignore_errors=True)
    return {"parameters": params, "vocab_size": len(tokenizer), **counts, **stats}


def _read_text(path: Path) -> str | None:
    return read_text(path) if path.is_file() else None


# Settings that change neither the weights nor metrics.json: a shipped build made with other values still applies.
_NOT_DECISIVE = ("threads", "checkpoint_steps", "eval_batch_size", "shipped")


def build_settings(config: Config) -> str:
    """What decides the built base (its `build_config.yaml`): a build is resumed or reused only when these match.

    `base` is one flat mapping, the corpus keys in the place of `corpus`, as builds wrote it before the corpus
    keys had their own section: the shipped build's file stays a match.
    """
    base = {}
    for name, value in asdict(config.base).items():
        if name == "corpus":
            base.update(value)
        elif name not in _NOT_DECISIVE:
            base[name] = value
    return yaml.safe_dump({"seed": config.seed, "base": base, "task": flat_settings(config.task)}, sort_keys=False)


# --- the shipped build ----------------------------------------------------------------------------------------------


def shipped_base(config: Config) -> Path | None:
    """`base.shipped` when it holds a complete build of exactly these settings, else None (with the reason)."""
    if not config.base.shipped:
        return None
    folder = Path(config.base.shipped)
    if not folder.exists() and (REPO / folder).exists():  # the bundled `models/tiny-base`, run from elsewhere
        folder = REPO / folder
    if not (folder / "metrics.json").is_file():
        print0(f"base: base.shipped={folder} holds no complete build (no metrics.json); building from the code")
        return None
    if _read_text(folder / "build_config.yaml") != build_settings(config):
        print0(f"base: the build in base.shipped={folder} was made with other settings (its build_config.yaml "
               "differs from this recipe's seed, base and task); building from the code")
        return None
    return folder


def copy_shipped_base(folder: Path, run: RunDir) -> None:
    partial = run.root / ".base.shipped.partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(folder, partial)
    partial.rename(run.base)
    accuracy = read_json(run.base / "metrics.json")["accuracy"]
    log_metrics(run.metrics, "base", shipped_from=str(folder), accuracy=accuracy)
    print0(f"base: copied the shipped build {folder} (greedy {accuracy:.1%} on held-out problems) into {run.base}; "
           "`redumix base` builds it from the code instead")


# --- the stage ------------------------------------------------------------------------------------------------------


def ensure_base(config: Config, run: RunDir) -> None:
    """The embedded default on first use, by rank 0 while the others wait: the shipped build when it matches the
    recipe's settings, else built from the code."""
    if config.model.path == "base" and not base_is_complete(run):
        if rank() == 0:
            shipped = shipped_base(config)
            if shipped is not None and not run.base.exists():
                copy_shipped_base(shipped, run)
            else:
                print0("base: the embedded default model is not built yet; building it first")
                run_base(config, run)
        barrier()


def run_base(config: Config, run: RunDir) -> None:
    start = time.perf_counter()
    if base_is_complete(run):
        print0(f"base: complete ({run.base / 'metrics.json'} exists); delete {run.base} to rebuild")
        return
    require_arith(config)
    torch.set_num_threads(config.base.threads)
    if (run.base / "config.json").is_file() and (run.base / "build.json").is_file():
        print0(f"base: {run.base} holds a trained model without metrics; evaluating it")
        build = read_json(run.base / "build.json")
    else:
        # Kept across a crash: the next run resumes the build from its checkpoint.
        partial = run.root / ".base.partial"
        shutil.rmtree(run.base, ignore_errors=True)
        build = build_base(config, partial, run)
        atomic_write_json(partial / "build.json", build)
        partial.rename(run.base)
    model = AutoModelForCausalLM.from_pretrained(run.base).eval()
    tokenizer = AutoTokenizer.from_pretrained(run.base)
    measured = measure(model, tokenizer, make_task(config.task, config.seed), config.base, config.seed)
    metrics = {**measured, "build": build, "wall_seconds": round(time.perf_counter() - start, 1)}
    log_metrics(run.metrics, "base", **{k: v for k, v in measured.items() if not isinstance(v, dict)},
                wall_seconds=metrics["wall_seconds"])
    atomic_write_json(run.base / "metrics.json", metrics)  # the completion marker: last
    print0(f"base: greedy accuracy {measured['accuracy']:.1%} on {measured['n']} held-out problems"
           + (f"; x2-only redo after verifier feedback {measured['reflection_verifier']['redo_accuracy']:.1%}"
              if "reflection_verifier" in measured else "") + f" ({metrics['wall_seconds']:.0f} s)")
