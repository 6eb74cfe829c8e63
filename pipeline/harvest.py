"""`redumix harvest`: run ReDuMix over a task split and write original/redo pairs with p_mix into Arrow shards.

Resume and multi-process work the same way. The example list is fixed by the config, and shard k always holds
examples [k·S, (k+1)·S). A rank owns the shards k ≡ rank (mod world size) and skips the ones already on disk.
A shard appears atomically and its rows do not depend on which process made it or what ran before (sampling is
seeded per example and per stage, and batches are cut inside the shard). So a rerun after a crash, or a run on
another number of processes, produces the same rows, and `manifest.json`, written last by rank 0, marks the stage
complete. The fingerprint of the config sections that decide the rows guards against mixing shards of two configs.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from redumix.data.jsonl import read_jsonl_by_id
from redumix.data.shards import (
    bad_shards,
    encode_shard,
    iter_rows,
    read_shard,
    readable_rows,
    shard_name,
    shard_paths,
    shard_record,
)
from redumix.data.task import Example, Task
from redumix.data.tasks import flat_settings, make_task
from redumix.embedded.stage import ensure_base
from redumix.generate.model_io import load_model, stop_token_ids
from redumix.generate.redumix import FeedbackFn, RedumixResult, redumix_generate, task_feedback
from redumix.pipeline.config import Config
from redumix.pipeline.preflight import check_inputs
from redumix.pipeline.report import newcombe_paired_interval
from redumix.pipeline.resolve import config_to_yaml
from redumix.pipeline.run import (
    RunDir,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    barrier,
    init_distributed,
    log_metrics,
    model_path,
    peak_rss_mb,
    print0,
    rank,
    read_json,
    world_size,
)


def run_harvest(config: Config, run: RunDir, task: Task | None = None) -> None:
    """Harvest `task` (by default the one `config.task` names) into RUN_DIR/harvest."""
    task = task or make_task(config.task, config.seed)
    out = run.harvest
    settings = harvest_settings(config, task)
    fingerprint = harvest_fingerprint(config, task)
    manifest_path = out / "manifest.json"
    init_distributed()
    if manifest_path.exists():
        manifest = read_json(manifest_path)
        _check_fingerprint(manifest.get("fingerprint"), fingerprint, out, settings)
        bad = bad_shards(out, manifest.get("shard_files", {}))
        if not bad:
            print0(f"harvest: complete ({manifest_path}), skipping. Delete {out} to harvest again.")
            return
        print0(f"harvest: {', '.join(bad)} no longer match manifest.json; redoing those shards only")
        if rank() == 0:
            for name in bad:
                (out / name).unlink(missing_ok=True)
            manifest_path.unlink()
        barrier()
    ensure_base(config, run)
    # Every input is checked before the folder is claimed, so a fixed rerun is not refused as another config.
    skip = config.harvest.skip
    examples = task.examples(config.harvest.split, skip + config.harvest.n)[skip:]
    if not examples:
        raise ValueError(
            f"harvest: task {task.name!r} gives no examples in split {config.harvest.split!r} "
            f"(harvest.split, harvest.n={config.harvest.n}); point the task at data that has some"
        )
    if config.redumix.feedback == "human":
        _check_human_feedback(config.redumix.feedback_file, examples)
    check_inputs(config.model, model_path(config.model.path, run), examples, config.sampling.max_new_tokens)
    _claim_folder(out, config, fingerprint, settings)

    rows_per_shard = config.harvest.shard_rows
    n_shards = math.ceil(len(examples) / rows_per_shard)
    if rank() == 0:
        _drop_unusable_shards(out, n_shards, examples, rows_per_shard, fingerprint)
    barrier()
    mine = [k for k in range(n_shards) if k % world_size() == rank()]
    todo = [k for k in mine if not (out / shard_name(k)).exists()]
    if len(todo) < len(mine):
        print0(f"harvest: resuming, {len(mine) - len(todo)} of {len(mine)} shards already on disk")

    if todo:
        harvest_shards(config, run, task, examples, todo)
    barrier()
    if rank() == 0:
        manifest = harvest_manifest(config, out, n_shards, fingerprint)
        atomic_write_json(manifest_path, manifest)  # last: its presence means the stage is complete
        log_metrics(run, "harvest", **{k: v for k, v in manifest.items() if isinstance(v, (int, float))})
        print0(format_summary(manifest))


def _drop_unusable_shards(
    out: Path, n_shards: int, examples: list[Example], rows_per_shard: int, fingerprint: str
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
        problem = _shard_problem(path, wanted, fingerprint)
        if problem:
            print0(f"harvest: {path.name} {problem}; redoing it")
            path.unlink()


def _shard_problem(path: Path, ids: list[str], fingerprint: str) -> str | None:
    if readable_rows(path) != len(ids):
        return f"is damaged (does not read as {len(ids)} rows)"
    try:
        table = read_shard(path)
    except ValueError as exc:
        return f"is not a shard this version of redumix reads ({exc})"
    if table["id"].to_pylist() != ids:
        return "holds other examples than this run's (it was made by another run)"
    found = sorted({json.loads(meta).get("fingerprint") for meta in table["meta"].to_pylist()})
    if found != [fingerprint]:
        theirs = ", ".join(map(str, found))
        return f"was made with another config (its rows' fingerprint {theirs}, this run's {fingerprint})"
    return None


def harvest_shards(config: Config, run: RunDir, task: Task, examples: list[Example], shards: list[int]) -> None:
    path = model_path(config.model.path, run)
    model, tokenizer = load_model(path, config.model)
    stop_ids = stop_token_ids(model, tokenizer)
    size = config.harvest.shard_rows
    total = sum(len(examples[k * size : (k + 1) * size]) for k in shards)
    bar = tqdm(total=total, desc=f"harvest[rank {rank()}]", unit="ex", disable=rank() != 0 and world_size() > 1)
    redos_right = redos_done = 0  # the bar's running redo accuracy over this run's shards, not the current one's
    for k in shards:
        shard = examples[k * size : (k + 1) * size]
        rows = []
        for start in range(0, len(shard), config.harvest.batch_size):
            batch = shard[start : start + config.harvest.batch_size]
            began = time.perf_counter()
            results = redumix_generate(
                model, tokenizer, [e.prompt for e in batch], [e.id for e in batch], config.redumix, config.sampling,
                config.seed, stop_ids, feedback_fn(config, task, batch),
            )
            seconds = (time.perf_counter() - began) / len(batch)
            made = [make_row(e, r, config, task, str(path), seconds) for e, r in zip(batch, results, strict=True)]
            rows += made
            redos_right += sum(bool(r["redo_correct"]) for r in made)
            redos_done += len(made)
            bar.update(len(batch))
            bar.set_postfix(redo_acc=f"{redos_right / redos_done:.3f}")
        atomic_write_bytes(run.harvest / shard_name(k), encode_shard(rows))
        log_metrics(run, "harvest", shard=k, rows=len(rows))
    bar.close()


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
    example: Example, result: RedumixResult, config: Config, task: Task, model: str, seconds: float
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
        },
    }


# --- completion, fingerprints, summary ----------------------------------------------------------------------------


def harvest_fingerprint(config: Config, task: Task) -> str:
    """Hash of everything that decides the rows (not batch size: rows do not depend on it)."""
    return hashlib.sha256(json.dumps(harvest_settings(config, task), sort_keys=True).encode()).hexdigest()[:16]


def harvest_settings(config: Config, task: Task) -> dict:
    """The settings that decide the rows: the fingerprint hashes them, and fingerprint.json keeps them so that a
    refused config can name the keys that differ."""
    return {
        "task_name": task.name,
        "seed": config.seed,
        # compile_decoding changes speed and float rounding only, as the batch size does: a harvest may resume with
        # it switched.
        "model": {k: v for k, v in asdict(config.model).items() if k != "compile_decoding"},
        "base": _flat(asdict(config.base)) if config.model.path == "base" else None,
        "task": flat_settings(config.task),  # the flat layout harvests were fingerprinted with before
        "sampling": asdict(config.sampling),
        "redumix": asdict(config.redumix),
        "harvest": {"n": config.harvest.n, "split": config.harvest.split, "shard_rows": config.harvest.shard_rows,
                    # only when set, so that harvests made before `skip` existed keep their fingerprint
                    **({"skip": config.harvest.skip} if config.harvest.skip else {})},
    }


def _flat(section: dict) -> dict:
    """A section with its subsections' keys lifted to the top: the layout harvests were fingerprinted with before
    `base.corpus` had its own section, so those harvests still resume."""
    flat = {}
    for key, value in section.items():
        flat.update(value if isinstance(value, dict) else {key: value})
    return flat


def _check_fingerprint(found: str | None, expected: str, out: Path, settings: dict) -> None:
    if found != expected:
        raise ValueError(
            f"{out} holds a harvest made with a different config (fingerprint {found}, this config {expected}; "
            f"{_differences(out / 'fingerprint.json', settings)}); use another --run-dir, or delete that folder to "
            "harvest again"
        )


def _differences(marker: Path, settings: dict) -> str:
    """`what differs: redumix.lam: 0.5 -> 0.7, ...`, from the settings that fingerprint.json keeps."""
    try:
        theirs = read_json(marker).get("settings")
    except (OSError, ValueError):
        theirs = None
    if not isinstance(theirs, dict):
        return f"{marker.name} predates the stored settings, so the keys that differ are not known"
    ours, theirs = _dotted(json.loads(json.dumps(settings))), _dotted(theirs)  # JSON's types on both sides
    missing = "(unset)"
    changed = [f"{key}: {json.dumps(theirs.get(key, missing))} -> {json.dumps(ours.get(key, missing))}"
               for key in sorted(ours.keys() | theirs.keys()) if theirs.get(key, missing) != ours.get(key, missing)]
    return "what differs: " + ", ".join(changed) if changed else "the stored settings match; only the hash differs"


def _dotted(settings: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            flat.update(_dotted(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def _claim_folder(out: Path, config: Config, fingerprint: str, settings: dict) -> None:
    """Record which config the shards in `out` belong to, or refuse to mix in shards of another config."""
    marker = out / "fingerprint.json"
    if rank() == 0:
        if marker.exists():
            _check_fingerprint(read_json(marker).get("fingerprint"), fingerprint, out, settings)
        elif shard_paths(out):
            raise ValueError(f"{out} holds shards but no fingerprint.json; delete the folder to harvest again")
        else:
            atomic_write_json(marker, {"fingerprint": fingerprint, "settings": settings})
            atomic_write_text(out / "config.yaml", config_to_yaml(config))
    barrier()
    if rank() != 0:
        _check_fingerprint(read_json(marker).get("fingerprint"), fingerprint, out, settings)


def check_harvest(folder: Path) -> None:
    """A complete harvest whose shards still match their manifest, or an error that says what to do."""
    manifest_path = Path(folder) / "manifest.json"
    if not manifest_path.exists():
        raise FileNotFoundError(f"{folder}: no complete harvest (no manifest.json); run `redumix harvest` first")
    manifest = read_json(manifest_path)
    if "shard_files" in manifest and not manifest["shard_files"]:
        raise ValueError(
            f"{folder}: the harvest is empty ({manifest_path} lists no shards); delete {folder} and run "
            "`redumix harvest` again on a task split that has examples"
        )
    bad = bad_shards(folder, manifest.get("shard_files", {}))
    if bad:
        raise ValueError(
            f"{folder}: {', '.join(bad)} no longer match manifest.json (truncated, corrupt or changed after the "
            "harvest wrote them); run `redumix harvest` again, which redoes those shards only"
        )


def harvest_manifest(config: Config, out: Path, n_shards: int, fingerprint: str) -> dict:
    """manifest.json's content: the shards with their rows and hashes, and the harvest's totals over every row."""
    paths = [out / shard_name(k) for k in range(n_shards)]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise RuntimeError(f"harvest: shards {missing} are missing after every rank finished; rerun the harvest")
    n = original_right = redo_right = fixed = broken = graded = redo_tokens = fpe = 0
    seconds = 0.0
    for row in iter_rows(paths):
        meta = json.loads(row["meta"])
        n += 1
        redo_tokens += len(row["redo_token_ids"])
        fpe += meta["fpe"]
        seconds += meta["seconds"]
        if row["original_correct"] is not None:
            graded += 1
            original_right += row["original_correct"]
            redo_right += row["redo_correct"]
            fixed += (not row["original_correct"]) and row["redo_correct"]
            broken += row["original_correct"] and not row["redo_correct"]
    return {
        "fingerprint": fingerprint,
        "rows": n,
        "skip": config.harvest.skip,  # the rows are the split's examples [skip, skip + rows)
        "shards": [p.name for p in paths],
        "shard_files": {p.name: shard_record(p) for p in paths},  # rows and SHA-256: train and reruns check them
        "shard_bytes": sum(p.stat().st_size for p in paths),
        "graded": graded,
        "original_accuracy": original_right / max(graded, 1),
        "redo_accuracy": redo_right / max(graded, 1),
        "fixed": fixed,
        "broken": broken,
        # redo − original on the same rows, with the 95% Newcombe interval for paired proportions
        "change_interval": list(newcombe_paired_interval(redo_right - fixed, fixed, broken,
                                                         graded - redo_right - broken)),
        "lam": config.redumix.lam,
        "feedback": config.redumix.feedback,
        "redo_tokens": redo_tokens,
        "fpe": fpe,
        "decode_seconds": round(seconds, 2),
        "examples_per_s": round(n / seconds, 2) if seconds else None,
        "peak_rss_mb": peak_rss_mb(),  # this process's (rank 0's) peak: shards stream, so n does not raise it
    }


def format_summary(m: dict) -> str:
    line = (
        f"harvest: {m['rows']} rows in {len(m['shards'])} shards ({m['shard_bytes'] / 1e6:.1f} MB). "
        f"original accuracy {m['original_accuracy']:.1%} -> redo accuracy {m['redo_accuracy']:.1%} "
        f"(λ={m['lam']}, {m['feedback']} feedback; fixed {m['fixed']}, broke {m['broken']}, n={m['graded']}"
    )
    if m.get("change_interval"):  # manifests written before it was recorded have none
        low, high = m["change_interval"]
        line += (f"; change {100 * (m['redo_accuracy'] - m['original_accuracy']):+.1f} points, 95% paired interval "
                 f"[{100 * low:+.1f}, {100 * high:+.1f}]")
    return line + ")"
