"""`redumix harvest`: run ReDuMix over a task split and write original/redo pairs with p_mix into Arrow shards.

Resume and multi-process work the same way. The example list is fixed by the config, and shard k always holds
examples [k·S, (k+1)·S). A rank owns the shards k ≡ rank (mod world size) and skips the ones already on disk.
A shard appears atomically and its rows do not depend on which process made it or what ran before (sampling is
seeded per example and per stage, and batches are cut inside the shard). So a rerun after a crash, or a run on
another number of processes, produces the same rows, and `manifest.json`, written last by rank 0, marks the stage
complete. The fingerprint of the record of what decides the rows guards against mixing shards of two configs.
With `engine: vllm` the unit is an engine's group of `vllm.tensor_parallel_size` ranks (one rank unless a
model needs several devices): a group owns the shards k ≡ group (mod groups), and its first rank writes them.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from redumix.common.files import atomic_write_bytes, atomic_write_json, log_metrics, read_json
from redumix.common.ranks import barrier, init_distributed, print0, rank, world_size
from redumix.data.jsonl import read_jsonl_by_id
from redumix.data.shards import (
    bad_shards,
    encode_shard,
    read_shard,
    readable_rows,
    shard_name,
)
from redumix.data.task import Example, Task, grader_of
from redumix.data.tasks import make_task
from redumix.generate.engine import Engine
from redumix.generate.redumix import FeedbackFn, RedumixResult, redumix_generate, task_feedback
from redumix.pipeline.config import Config
from redumix.pipeline.embedded_stage import ensure_embedded
from redumix.pipeline.engines import builds_collectively, check_engine, open_engine
from redumix.pipeline.harvest_folder import (
    accept_folder,
    claim_folder,
    format_summary,
    harvest_fingerprint,
    harvest_manifest,
    harvest_record,
)
from redumix.pipeline.preflight import check_inputs
from redumix.pipeline.run import RunDir, model_path


def run_harvest(config: Config, run: RunDir, task: Task | None = None) -> None:
    """Harvest `task` (by default the one `config.task` names) into RUN_DIR/harvest."""
    task = task or make_task(config.task, config.seed)
    out = run.harvest
    record = harvest_record(config, task)
    fingerprint = harvest_fingerprint(config, task)
    manifest_path = out / "manifest.json"
    init_distributed()
    if manifest_path.exists():
        manifest = read_json(manifest_path)
        accept_folder(out, record, manifest.get("fingerprint"))
        bad = bad_shards(out, manifest.get("shard_files", {}))
        if not bad:
            print0(f"harvest: complete ({manifest_path}), skipping. Delete {out} to harvest again.")
            return
        print0(f"harvest: {', '.join(bad)} no longer match manifest.json; redoing those shards only")
        # Every rank has seen the manifest before rank 0 removes it: a rank that started late would otherwise find
        # none, skip the barrier below, and be one barrier off from then on (a hang once vLLM's engine build, a
        # collective, meets another rank's barrier).
        barrier()
        if rank() == 0:
            for name in bad:
                (out / name).unlink(missing_ok=True)
            manifest_path.unlink()
        barrier()
    ensure_embedded(config, run)
    # Every input is checked before the folder is claimed, so a fixed rerun is not refused as another config.
    skip = config.harvest.skip
    problems = task.examples(config.harvest.split, skip + config.harvest.n)[skip:]
    examples = [e for e in problems for _ in range(config.harvest.attempts)]  # each problem's attempts in a row
    if not examples:
        raise ValueError(
            f"harvest: task {task.name!r} gives no examples in split {config.harvest.split!r} "
            f"(harvest.split, harvest.n={config.harvest.n}); point the task at data that has some"
        )
    if config.redumix.feedback == "human":
        _check_human_feedback(config.redumix.feedback_file, examples)
    if config.redumix.feedback == "reference" and config.harvest.split != "train":
        raise ValueError("redumix.feedback=reference shows the reference solution, so it harvests train problems "
                         f"only; harvest.split is {config.harvest.split!r}: set harvest.split=train")
    group, groups = check_engine(config, run)  # who shares a shard: each rank alone, or an engine's ranks
    check_inputs(config.model, model_path(config.model.path, run), examples, config.sampling.max_new_tokens)
    accepted = claim_folder(out, config, record)  # this run's fingerprint, and a migrated folder's older one

    rows_per_shard = config.harvest.shard_rows
    n_shards = math.ceil(len(examples) / rows_per_shard)
    if rank() == 0:
        _drop_unusable_shards(out, n_shards, examples, rows_per_shard, accepted)
    barrier()
    mine = [k for k in range(n_shards) if k % groups == group]
    todo = [k for k in mine if not (out / shard_name(k)).exists()]
    if len(todo) < len(mine):
        print0(f"harvest: resuming, {len(mine) - len(todo)} of {len(mine)} shards already on disk")

    if todo or builds_collectively(config):
        ranks_per_group = world_size() // groups
        harvest_shards(config, run, task, examples, todo, writes=rank() % ranks_per_group == 0)
    barrier()
    if rank() == 0:
        manifest = harvest_manifest(config, out, n_shards, fingerprint, grader_of(task))
        atomic_write_json(manifest_path, manifest)  # last: its presence means the stage is complete
        log_metrics(run.metrics, "harvest", **{k: v for k, v in manifest.items() if isinstance(v, (int, float))})
        print0(format_summary(manifest))


def _drop_unusable_shards(
    out: Path, n_shards: int, examples: list[Example], rows_per_shard: int, accepted: frozenset[str]
) -> None:
    """Delete the shards on disk that this run cannot take in, each with a message naming it, so the resume redoes
    them: one that does not read whole, holds other examples, or whose rows' own `meta.fingerprint` is another
    config's (a shard copied from another run, with the right row count).

    A shard appears atomically, so damage is done after it was written (a disk fault, a copy cut short); a complete
    harvest is checked against its manifest's checksums instead.
    """
    for k in range(n_shards):
        path = out / shard_name(k)
        if not path.exists():
            continue
        wanted = [e.id for e in examples[k * rows_per_shard : (k + 1) * rows_per_shard]]
        problem = _shard_problem(path, wanted, accepted)
        if problem:
            print0(f"harvest: {path.name} {problem}; redoing it")
            path.unlink()


def _shard_problem(path: Path, ids: list[str], accepted: frozenset[str]) -> str | None:
    if readable_rows(path) != len(ids):
        return f"is damaged (does not read as {len(ids)} rows)"
    try:
        table = read_shard(path)
    except ValueError as exc:
        return f"is not a shard this version of redumix reads ({exc})"
    if table["id"].to_pylist() != ids:
        return "holds other examples than this run's (it was made by another run)"
    found = {json.loads(meta).get("fingerprint") for meta in table["meta"].to_pylist()}
    if not found <= accepted:
        theirs, ours = ", ".join(sorted(map(str, found))), ", ".join(sorted(accepted))
        return f"was made with another config (its rows' fingerprint {theirs}, this run's {ours})"
    return None


def harvest_shards(config: Config, run: RunDir, task: Task, examples: list[Example], shards: list[int],
                   writes: bool = True) -> None:
    """Harvest `shards` into RUN_DIR/harvest. `writes` is False on the ranks of a tensor-parallel engine but its
    first: they decode the same rows in step with it, and one copy of each shard is written."""
    path = model_path(config.model.path, run)
    engine = open_engine(config, path)
    size = config.harvest.shard_rows

    def places_of(k: int) -> range:  # shard k's rows, by their place in `examples`
        return range(k * size, min((k + 1) * size, len(examples)))

    total = sum(len(places_of(k)) for k in shards)
    bar = tqdm(total=total, desc=f"harvest[rank {rank()}]", unit="ex", disable=rank() != 0 and world_size() > 1)
    redos_right = redos_done = 0  # the bar's running redo accuracy over this run's shards, not the current one's
    # A batch larger than a shard decodes several whole shards together: an engine whose step costs about the same
    # for 32 rows as for 96 (vLLM on a CPU, docs/code.md) then needs a third of the steps. A shard is still written
    # whole and alone, and its rows do not depend on the batch (each row's noise is its own).
    per_batch = max(1, config.harvest.batch_size // size)
    for g in range(0, len(shards), per_batch):
        group = shards[g : g + per_batch]
        places = [i for k in group for i in places_of(k)]
        rows: dict[int, dict] = {}  # place in `examples` -> its row
        for start in range(0, len(places), config.harvest.batch_size):
            here = places[start : start + config.harvest.batch_size]
            batch = [examples[i] for i in here]
            began = time.perf_counter()
            tries = [i % config.harvest.attempts for i in here]  # each example comes `attempts` times in a row
            results = redo_batch(engine, config, task, batch, tries)
            seconds = (time.perf_counter() - began) / len(batch)
            made = [make_row(e, r, config, task, str(path), seconds, j)
                    for e, r, j in zip(batch, results, tries, strict=True)]
            rows.update(zip(here, made, strict=True))
            redos_right += sum(bool(r["redo_correct"]) for r in made)
            redos_done += len(made)
            bar.update(len(batch))
            bar.set_postfix(redo_acc=f"{redos_right / redos_done:.3f}")
        for k in group:
            if writes:
                shard_rows = [rows[i] for i in places_of(k)]
                atomic_write_bytes(run.harvest / shard_name(k), encode_shard(shard_rows))
                log_metrics(run.metrics, "harvest", shard=k, rows=len(shard_rows))
    bar.close()
    engine.close()


def redo_batch(engine: Engine, config: Config, task: Task, batch: list[Example], tries: list[int]
               ) -> list[RedumixResult]:
    """ReDuMix on a batch of rows, row i attempt tries[i] of its example. With a greedy attempt, critique and
    reflection (`sampling` greedy), a problem's attempts differ only in their redo: its stages 1-3 are decoded once,
    from its first row in the batch, and every row draws its own redo from them."""
    keys = [seed_key(e.id, j) for e, j in zip(batch, tries, strict=True)]
    if config.harvest.attempts == 1 or not config.sampling.greedy:
        return redumix_generate(engine, [e.prompt for e in batch], keys, config.redumix, config.sampling,
                                config.seed, feedback_fn(config, task, batch))
    ids = [e.id for e in batch]
    distinct = list({e.id: e for e in batch}.values())  # in the order of their first rows
    place = {e.id: i for i, e in enumerate(distinct)}
    return redumix_generate(engine, [e.prompt for e in distinct], [keys[ids.index(e.id)] for e in distinct],
                            config.redumix, config.sampling, config.seed, feedback_fn(config, task, distinct),
                            redos=[(place[e.id], key) for e, key in zip(batch, keys, strict=True)])


def seed_key(example_id: str, attempt: int) -> str:
    """What an attempt's noise derives from: the example's id for the first, so a one-attempt harvest's rows are
    the first attempts of a larger one, and `id/attempt` for the others."""
    return example_id if attempt == 0 else f"{example_id}/{attempt}"


def feedback_fn(config: Config, task: Task, batch: list[Example]) -> FeedbackFn | None:
    """r for each example: the verifier's verdict, the human's line for its id, or None (the model critiques)."""
    if config.redumix.feedback != "human":
        return task_feedback(config.redumix.feedback, task, batch, config.seed)
    human = _human_feedback(config.redumix.feedback_file)  # every id was checked before the harvest began
    return lambda i, attempt: human[batch[i].id]


def _check_human_feedback(path: str, examples: list[Example]) -> None:
    """Every example to harvest has its line in the feedback file, or an error naming the file and the ids."""
    human = _human_feedback(path)
    missing = [e.id for e in examples if e.id not in human]
    if missing:
        raise ValueError(
            f"{path}: no feedback for {len(missing)} of the {len(examples)} examples to harvest, e.g. ids "
            f"{missing[:3]}; add one line {{\"id\": ..., \"feedback\": ...}} for each (ids look like "
            f"{examples[0].id!r}), or set redumix.feedback=verifier"
        )


_HUMAN: dict[str, dict[str, str]] = {}


def _human_feedback(path: str) -> dict[str, str]:
    if path not in _HUMAN:
        _HUMAN[path] = read_jsonl_by_id(Path(path), "feedback")
    return _HUMAN[path]


def make_row(
    example: Example, result: RedumixResult, config: Config, task: Task, model: str, seconds: float, attempt: int = 0
) -> dict:
    graded = bool(example.reference)
    return {
        "id": example.id,
        "task": example.task,
        "prompt": example.prompt,
        "reference": example.reference,
        "original": result.original,
        "original_correct": task.is_correct(result.original, example) if graded else None,
        "feedback": result.feedback,
        "reflection": result.reflection,
        "redo": result.redo,
        "redo_correct": task.is_correct(result.redo, example) if graded else None,
        "redo_token_ids": result.redo_token_ids,
        "mix_topk_ids": result.topk_ids,
        "mix_topk_logprobs": result.topk_logprobs,
        "mix_tail_logprob": result.tail_logprobs,
        "x2_token_ids": result.x2_ids,
        "lam": result.meta["lam"],
        "meta": {
            **result.meta,
            "model": model,
            "fingerprint": harvest_fingerprint(config, task),
            "seed": config.seed,
            "sampling": asdict(config.sampling),
            "redumix": asdict(config.redumix),
            "seconds": round(seconds, 4),
            **({"attempt": attempt} if config.harvest.attempts > 1 else {}),
        },
    }
