"""Lineage: which inputs a stage's outputs were made from.

A stage records the content hashes of its inputs (the base weights, the harvest's manifest, the train output's
marker) in its completion marker. A rerun compares them with the inputs on disk: a stage whose inputs changed since it
completed is stale, and is redone rather than reported "already complete". Hashes are of bytes, not timestamps, so a
copied or re-extracted input that is the same stays the same.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

_CHUNK = 1 << 20


def file_id(path: Path) -> str | None:
    """SHA-256 (16 hex digits) of a file's bytes, or None when it does not exist."""
    path = Path(path)
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()[:16]


# Keys of config.json that say which library wrote the folder, not which model it holds: the same weights saved by
# two transformers releases (`make vllm` pins an older one) are the same model, and records made with one are its.
_WRITER_KEYS = frozenset({"transformers_version"})


def model_id(folder: Path) -> str | None:
    """The hash of a model folder's weights and config.json (less `_WRITER_KEYS`), or None when it holds no model."""
    folder = Path(folder)
    ids = [f"{f.name}:{file_id(f)}" for f in sorted(folder.glob("*.safetensors"))]
    config = folder / "config.json"
    if config.is_file():
        settings = {k: v for k, v in json.loads(config.read_text()).items() if k not in _WRITER_KEYS}
        ids.append("config.json:" + hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16])
    return hashlib.sha256("|".join(ids).encode()).hexdigest()[:16] if ids else None


def harvest_id(folder: Path) -> str | None:
    """A harvest is its manifest: it lists every shard's SHA-256."""
    return file_id(Path(folder) / "manifest.json")


def changed_inputs(recorded: dict | None, current: dict) -> list[str]:
    """The names of the inputs whose hash differs from the recorded one (all of them when none were recorded)."""
    if not recorded:
        return sorted(current)
    return sorted(name for name in current if recorded.get(name) != current[name])
