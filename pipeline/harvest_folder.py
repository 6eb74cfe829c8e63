"""A harvest folder's identity and its completion contract, apart from the stage that writes one.

Identity: the fingerprint of the record of what decides the rows (`harvest_record`), kept in `fingerprint.json`
with the record itself, so that a refused config can name the keys that differ (`claim_folder`); a marker of an
older redumix is read and rewritten in the current record version (`accept_folder`, docs/robustness.md).

Completion: `manifest.json`, written last, lists every shard with its rows and SHA-256; `check_harvest` is what
`train`, `export` and `ablation` call before they read a harvest, and `format_summary` is the stage's one summary
line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redumix.common.files import atomic_write_json, atomic_write_text, read_json
from redumix.common.fingerprints import RECORD_VERSION, fingerprint, harvest_record_v0, v0_hash
from redumix.common.ranks import barrier, peak_rss_mb, print0, rank
from redumix.data.shards import bad_shards, iter_rows, shard_name, shard_paths, shard_record
from redumix.data.task import Task
from redumix.data.tasks import task_record
from redumix.embedded import build_record
from redumix.generate.vllm_engine import vllm_version
from redumix.pipeline.config import Config
from redumix.pipeline.resolve import config_to_yaml
from redumix.pipeline.run import EMBEDDED
from redumix.pipeline.stats import newcombe_paired_interval

MARKER = "fingerprint.json"


def harvest_record(config: Config, task: Task) -> dict[str, Any]:
    """What decides the rows, in the record's own names (common/fingerprints.py). Not the batch size, the engine, the
    device, compile_decoding or static_cache: they change speed and float rounding only, so a harvest may resume
    under another."""
    sampling, redumix, harvest = config.sampling, config.redumix, config.harvest
    return {
        "seed": config.seed,
        "task": {**task_record(config.task), "name": task.name},  # a task passed in (a test's) names itself
        "model": {"path": config.model.path, "dtype": config.model.dtype},
        "embedded": build_record(config.embedded, config.task, config.seed) if config.model.path == EMBEDDED else None,
        "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                     "max_new_tokens": sampling.max_new_tokens},
        "redumix": {"lam": redumix.lam, "topk": redumix.topk, "feedback": redumix.feedback,
                    "feedback_file": redumix.feedback_file if redumix.feedback == "human" else None,
                    "reflection_max_tokens": redumix.reflection_max_tokens,
                    "critique_max_tokens": redumix.critique_max_tokens, "instruction": redumix.instruction,
                    "redo_temperature": redumix.redo_temperature},
        "harvest": {"n": harvest.n, "split": harvest.split, "skip": harvest.skip, "shard_rows": harvest.shard_rows,
                    # only when set, so the harvests made before it existed keep their fingerprints
                    **({"attempts": harvest.attempts} if harvest.attempts != 1 else {})},
    }


def harvest_fingerprint(config: Config, task: Task) -> str:
    return fingerprint(harvest_record(config, task))


# --- the folder's marker: fingerprint.json --------------------------------------------------------------------------


@dataclass(frozen=True)
class Marker:
    """What `fingerprint.json` says: the record the folder's rows were made with (None when a marker of version 0
    is too old to hold it), the fingerprints its shards and manifest may carry (a migrated folder's older rows carry
    the version 0 one), and whether it is of version 0."""

    record: dict[str, Any] | None
    fingerprints: frozenset[str]
    old: bool

    def as_json(self) -> dict[str, Any]:
        """The marker in the current version; a version 0 fingerprint is kept as `migrated_from`."""
        assert self.record is not None
        current = fingerprint(self.record)
        older = sorted(self.fingerprints - {current})
        return {"version": RECORD_VERSION, "fingerprint": current, "record": self.record,
                **({"migrated_from": older} if older else {})}


def read_marker(folder: Path) -> Marker | None:
    """The harvest folder's marker, a version 0 one read into the current version (docs/robustness.md), or None."""
    path = Path(folder) / MARKER
    if not path.is_file():
        return None
    stored = read_json(path)
    if stored.get("version") == RECORD_VERSION:
        return Marker(stored["record"], frozenset([stored["fingerprint"], *stored.get("migrated_from", [])]), False)
    settings, found = stored.get("settings"), stored.get("fingerprint")
    known = isinstance(settings, dict) and v0_hash(settings) == found  # the settings that made the hash
    return Marker(harvest_record_v0(settings) if known else None, frozenset([str(found)]), True)


def check_marker(out: Path, marker: Marker, record: dict[str, Any], manifest: str | None = None) -> None:
    """Refuse a folder made with another record (naming each key that differs), or whose manifest carries a
    fingerprint that is not the folder's own."""
    if marker.record is None:
        raise ValueError(f"{out / MARKER} predates the stored settings (a harvest made before 2026-11-24), so whether "
                         "it was made with this config cannot be known; delete that folder to harvest again")
    changed = settings_differences(marker.record, record)
    if changed:
        raise ValueError(f"{out} holds a harvest made with a different config (what differs: {', '.join(changed)}); "
                         "use another --run-dir, or delete that folder to harvest again")
    if manifest is not None and manifest not in marker.fingerprints:
        raise ValueError(f"{out}/manifest.json carries fingerprint {manifest}, not this folder's ({MARKER}: "
                         f"{', '.join(sorted(marker.fingerprints))}); delete that folder to harvest again")


def accept_folder(out: Path, record: dict[str, Any], manifest: str | None = None) -> frozenset[str]:
    """The fingerprints this run takes in from `out`, once its marker says it was made with `record`; a version 0
    marker that matches is rewritten in the current version (rank 0), the one migration of an old folder."""
    marker = read_marker(out) or Marker(record, frozenset([fingerprint(record)]), False)  # none: its own rows only
    check_marker(out, marker, record, manifest)
    if marker.old and rank() == 0:
        atomic_write_json(out / MARKER, marker.as_json())
        print0(f"harvest: {out / MARKER} rewritten in record version {RECORD_VERSION} (it was made by an older "
               "redumix, with these settings)")
    return marker.fingerprints | {fingerprint(record)}


def made_with(folder: Path, record: dict[str, Any]) -> bool:
    """Whether `folder` holds a complete harvest made with `record` (ablation copies such a one)."""
    marker = read_marker(folder)
    complete = (Path(folder) / "manifest.json").is_file()
    return complete and marker is not None and marker.record is not None and not settings_differences(
        marker.record, record)


def settings_differences(theirs: dict, settings: dict) -> list[str]:
    """`key: old -> new` for every dotted key whose value differs between stored settings and these."""
    ours, theirs = _dotted(json.loads(json.dumps(settings))), _dotted(theirs)  # JSON's types on both sides
    missing = "(unset)"
    return [f"{key}: {json.dumps(theirs.get(key, missing))} -> {json.dumps(ours.get(key, missing))}"
            for key in sorted(ours.keys() | theirs.keys()) if theirs.get(key, missing) != ours.get(key, missing)]


def claim_settings(path: Path, record: dict[str, Any], records: str, remedy: str,
                   old: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
    """Records are resumed only under the record that made them (common/fingerprints.py): store it at `path` the
    first time (`version`, `fingerprint`, `record`, as a harvest's marker), and refuse, naming each key that differs,
    when it changes, writing nothing (`records` says what lies there, `remedy` what to do). A file of version 0, the
    config's layout, is read into the record by `old` and, when it matches, rewritten in the current version."""
    versioned = {"version": RECORD_VERSION, "fingerprint": fingerprint(record), "record": record}
    if not path.exists():
        atomic_write_json(path, versioned)
        return
    stored = read_json(path)
    version = stored.get("version", 0)
    try:
        theirs = stored["record"] if version == RECORD_VERSION else old(stored) if version == 0 and old else None
    except (KeyError, TypeError):  # a version 0 file in no layout that `old` knows
        theirs = None
    if theirs is None:
        raise ValueError(f"{path}: the {records} here were made by a redumix whose settings file (version "
                         f"{version}) this one cannot read; {remedy}")
    changed = settings_differences(theirs, record)
    if changed:
        raise ValueError(f"{path}: the {records} here were made with other settings ({', '.join(changed)}); {remedy}")
    if version != RECORD_VERSION:
        atomic_write_json(path, versioned)
        print0(f"{path} rewritten in record version {RECORD_VERSION} (the {records} were made by an older redumix, "
               "with these settings)")


def _dotted(settings: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            flat.update(_dotted(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def claim_folder(out: Path, config: Config, record: dict[str, Any]) -> frozenset[str]:
    """Record which config the shards in `out` belong to, or refuse to mix in shards of another config. Returns the
    fingerprints of the rows this run takes in."""
    marker = out / MARKER
    if rank() == 0:
        if marker.exists():
            accepted = accept_folder(out, record)
        elif shard_paths(out):
            raise ValueError(f"{out} holds shards but no {MARKER}; delete the folder to harvest again")
        else:
            accepted = frozenset([fingerprint(record)])
            atomic_write_json(marker, Marker(record, accepted, False).as_json())
            atomic_write_text(out / "config.yaml", config_to_yaml(config))
    barrier()
    if rank() != 0:
        accepted = accept_folder(out, record)
    return accepted


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


def harvest_manifest(config: Config, out: Path, n_shards: int, fingerprint: str, grader: dict | None = None) -> dict:
    """manifest.json's content: the shards with their rows and hashes, and the harvest's totals over every row."""
    paths = [out / shard_name(k) for k in range(n_shards)]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise RuntimeError(f"harvest: shards {missing} are missing after every rank finished; rerun the harvest")
    n = original_right = redo_right = fixed = broken = graded = redo_tokens = fpe = retried = 0
    seconds = 0.0
    engines = set()
    for row in iter_rows(paths):
        meta = json.loads(row["meta"])
        n += 1
        engine = meta.get("engine", {"name": "hf"})  # rows of the Hugging Face path carry no engine entry
        engines.add(engine["name"])
        retried += engine.get("retries", 0)
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
        "skip": config.harvest.skip,  # the rows are the split's examples [skip, skip + rows / attempts)
        "attempts": config.harvest.attempts,  # rows per example, in a row: example i's are rows [i·a, (i+1)·a)
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
        # the engines that decoded the rows (two after a resume on the other one), the ReDuMix pairs vLLM split and
        # decoded again (counted once per retry), and vLLM's version where it ran
        "engine": "+".join(sorted(engines)) or config.engine,
        "retried_pairs": retried,
        "vllm_version": vllm_version() if "vllm" in engines else None,
        "peak_rss_mb": peak_rss_mb(),  # this process's (rank 0's) peak: shards stream, so n does not raise it
        "grader": grader,  # what ran the model's code (the `code` task's sandbox layers and limits), else None
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
