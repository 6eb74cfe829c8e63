"""A harvest folder's identity and its completion contract, apart from the stage that writes one.

Identity: the fingerprint of the settings that decide the rows, kept in `fingerprint.json` with the settings
themselves, so that a refused config can name the keys that differ (`claim_folder`). Completion: `manifest.json`,
written last, lists every shard with its rows and SHA-256; `check_harvest` is what `train`, `export` and `ablation`
call before they read a harvest, and `format_summary` is the stage's one summary line.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from redumix.common.files import atomic_write_json, atomic_write_text, read_json
from redumix.common.ranks import barrier, peak_rss_mb, rank
from redumix.data.shards import bad_shards, iter_rows, shard_name, shard_paths, shard_record
from redumix.data.task import Task
from redumix.data.tasks import flat_settings
from redumix.generate.vllm_engine import vllm_version
from redumix.pipeline.config import Config
from redumix.pipeline.resolve import config_to_yaml
from redumix.pipeline.run import EMBEDDED
from redumix.pipeline.stats import newcombe_paired_interval


def harvest_fingerprint(config: Config, task: Task) -> str:
    """Hash of everything that decides the rows (not batch size: rows do not depend on it)."""
    return hashlib.sha256(json.dumps(harvest_settings(config, task), sort_keys=True).encode()).hexdigest()[:16]


def harvest_settings(config: Config, task: Task) -> dict:
    """The settings that decide the rows: the fingerprint hashes them, and fingerprint.json keeps them so that a
    refused config can name the keys that differ."""
    return {
        "task_name": task.name,
        "seed": config.seed,
        "model": model_settings(config),
        # the section's key and layout before it had its own name and subsections: older harvests still resume
        "base": _flat(asdict(config.embedded)) if config.model.path == EMBEDDED else None,
        "task": flat_settings(config.task),  # the flat layout harvests were fingerprinted with before
        "sampling": asdict(config.sampling),
        "redumix": redumix_settings(config),
        "harvest": {"n": config.harvest.n, "split": config.harvest.split, "shard_rows": config.harvest.shard_rows,
                    # only when set, so that harvests made before `skip` existed keep their fingerprint
                    **({"skip": config.harvest.skip} if config.harvest.skip else {})},
    }


def redumix_settings(config: Config) -> dict:
    """The redumix section, its redo instruction and temperature only where they are not the defaults, so that
    harvests made before those keys existed keep their fingerprint."""
    section = asdict(config.redumix)
    if section["instruction"] == "redo":
        del section["instruction"]
    if section["redo_temperature"] is None:
        del section["redo_temperature"]
    return section


def model_settings(config: Config) -> dict:
    """The model section as harvests were fingerprinted with it. compile_decoding changes speed and float rounding
    only, as the batch size does, so a harvest may resume with it switched. The embedded model's path is recorded as
    'base', its name before the rename, so that its harvests keep their fingerprint."""
    model = {k: v for k, v in asdict(config.model).items() if k != "compile_decoding"}
    if model["path"] == EMBEDDED:
        model["path"] = "base"
    return model


def _flat(section: dict) -> dict:
    """A section with its subsections' keys lifted to the top: the layout harvests were fingerprinted with before
    `base.corpus` had its own section, so those harvests still resume."""
    flat = {}
    for key, value in section.items():
        flat.update(value if isinstance(value, dict) else {key: value})
    return flat


def check_fingerprint(found: str | None, expected: str, out: Path, settings: dict) -> None:
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
    changed = settings_differences(theirs, settings)
    return "what differs: " + ", ".join(changed) if changed else "the stored settings match; only the hash differs"


def settings_differences(theirs: dict, settings: dict) -> list[str]:
    """`key: old -> new` for every dotted key whose value differs between stored settings and these."""
    ours, theirs = _dotted(json.loads(json.dumps(settings))), _dotted(theirs)  # JSON's types on both sides
    missing = "(unset)"
    return [f"{key}: {json.dumps(theirs.get(key, missing))} -> {json.dumps(ours.get(key, missing))}"
            for key in sorted(ours.keys() | theirs.keys()) if theirs.get(key, missing) != ours.get(key, missing)]


def claim_settings(path: Path, settings: dict, records: str, remedy: str) -> None:
    """Records are resumed only under the settings that made them: store the settings at `path` the first time, and
    refuse, naming each key that differs, when they change (`records` says what lies there, `remedy` what to do)."""
    if path.exists():
        changed = settings_differences(read_json(path), settings)
        if changed:
            raise ValueError(f"{path}: the {records} here were made with other settings ({', '.join(changed)}); "
                             f"{remedy}")
        return
    atomic_write_json(path, settings)


def _dotted(settings: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            flat.update(_dotted(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def claim_folder(out: Path, config: Config, fingerprint: str, settings: dict) -> None:
    """Record which config the shards in `out` belong to, or refuse to mix in shards of another config."""
    marker = out / "fingerprint.json"
    if rank() == 0:
        if marker.exists():
            check_fingerprint(read_json(marker).get("fingerprint"), fingerprint, out, settings)
        elif shard_paths(out):
            raise ValueError(f"{out} holds shards but no fingerprint.json; delete the folder to harvest again")
        else:
            atomic_write_json(marker, {"fingerprint": fingerprint, "settings": settings})
            atomic_write_text(out / "config.yaml", config_to_yaml(config))
    barrier()
    if rank() != 0:
        check_fingerprint(read_json(marker).get("fingerprint"), fingerprint, out, settings)


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
        # the engines that decoded the rows (two after a resume on the other one), the ReDuMix pairs vLLM split and
        # decoded again (counted once per retry), and vLLM's version where it ran
        "engine": "+".join(sorted(engines)) or config.harvest.engine,
        "retried_pairs": retried,
        "vllm_version": vllm_version() if "vllm" in engines else None,
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
