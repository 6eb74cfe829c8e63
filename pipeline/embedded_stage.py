"""`redumix embedded`: build the embedded default model into RUN_DIR/embedded, or reuse the shipped build.

The build itself is embedded/'s (`build_embedded`, `measure`); this stage places it in the run folder. Files appear
atomically: the model is built in `.embedded.partial/` and renamed to `embedded/`, and `embedded/metrics.json`, the
completion marker, is written last. A rerun after a crash resumes the build from its checkpoint; if `embedded/`
holds a model but no metrics (a crash during measuring), the rerun measures that model.

`ensure_embedded` is what the other stages call when `model.path=embedded`: the embedded model on first use,
copied from `embedded.shipped` when that build was made from exactly this recipe's settings (`built_with`),
else built from the code.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from redumix.common.files import atomic_write_json, log_metrics, read_json
from redumix.common.ranks import barrier, print0, rank
from redumix.data.tasks import make_task
from redumix.embedded import build_embedded, built_with, measure, require_arith
from redumix.pipeline.config import Config
from redumix.pipeline.run import EMBEDDED, RunDir, in_repo


def embedded_is_complete(run: RunDir) -> bool:
    return (run.embedded / "metrics.json").is_file()


# --- the shipped build ----------------------------------------------------------------------------------------------


def shipped_embedded(config: Config) -> Path | None:
    """`embedded.shipped` when it holds a complete build of exactly these settings, else None (with the reason)."""
    if not config.embedded.shipped:
        return None
    folder = in_repo(config.embedded.shipped)  # the bundled `models/tiny-base`, run from elsewhere
    if not (folder / "metrics.json").is_file():
        print0(f"embedded: embedded.shipped={folder} holds no complete build (no metrics.json); building from the "
               "code")
        return None
    if not built_with(folder, config.embedded, config.task, config.seed):
        print0(f"embedded: the build in embedded.shipped={folder} was made with other settings (its "
               "build_config.yaml differs from this recipe's seed, embedded and task); building from the code")
        return None
    return folder


def copy_shipped(folder: Path, run: RunDir) -> None:
    partial = run.root / ".embedded.shipped.partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(folder, partial)
    partial.rename(run.embedded)
    accuracy = read_json(run.embedded / "metrics.json")["accuracy"]
    log_metrics(run.metrics, "embedded", shipped_from=str(folder), accuracy=accuracy)
    print0(f"embedded: copied the shipped build {folder} (greedy {accuracy:.1%} on held-out problems) into "
           f"{run.embedded}; `redumix embedded` builds it from the code instead")


# --- the stage ------------------------------------------------------------------------------------------------------


def ensure_embedded(config: Config, run: RunDir) -> None:
    """The embedded model on first use, by rank 0 while the others wait: the shipped build when it matches the
    recipe's settings, else built from the code. Nothing when model.path names another model."""
    if config.model.path == EMBEDDED and not embedded_is_complete(run):
        barrier()  # every rank has looked before rank 0 makes it: a late rank would find it made, skip the barrier
        if rank() == 0:
            shipped = shipped_embedded(config)
            if shipped is not None and not run.embedded.exists():
                copy_shipped(shipped, run)
            else:
                print0("embedded: the embedded default model is not built yet; building it first")
                run_embedded(config, run)
        barrier()


def run_embedded(config: Config, run: RunDir) -> None:
    start = time.perf_counter()
    if embedded_is_complete(run):
        print0(f"embedded: complete ({run.embedded / 'metrics.json'} exists); delete {run.embedded} to rebuild")
        return
    require_arith(config.task)
    torch.set_num_threads(config.embedded.threads)
    if (run.embedded / "config.json").is_file() and (run.embedded / "build.json").is_file():
        print0(f"embedded: {run.embedded} holds a trained model without metrics; evaluating it")
        build = read_json(run.embedded / "build.json")
    else:
        # Kept across a crash: the next run resumes the build from its checkpoint.
        partial = run.root / ".embedded.partial"
        shutil.rmtree(run.embedded, ignore_errors=True)
        build = build_embedded(config.embedded, config.task, config.seed, partial, run.metrics)
        atomic_write_json(partial / "build.json", build)
        partial.rename(run.embedded)
    model = AutoModelForCausalLM.from_pretrained(run.embedded).eval()
    tokenizer = AutoTokenizer.from_pretrained(run.embedded)
    measured = measure(model, tokenizer, make_task(config.task, config.seed), config.embedded, config.seed)
    metrics = {**measured, "build": build, "wall_seconds": round(time.perf_counter() - start, 1)}
    log_metrics(run.metrics, "embedded", **{k: v for k, v in measured.items() if not isinstance(v, dict)},
                wall_seconds=metrics["wall_seconds"])
    atomic_write_json(run.embedded / "metrics.json", metrics)  # the completion marker: last
    print0(f"embedded: greedy accuracy {measured['accuracy']:.1%} on {measured['n']} held-out problems"
           + (f"; x2-only redo after verifier feedback {measured['reflection_verifier']['redo_accuracy']:.1%}"
              if "reflection_verifier" in measured else "") + f" ({metrics['wall_seconds']:.0f} s)")
