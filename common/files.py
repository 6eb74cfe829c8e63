"""Files every layer writes and reads: atomic writes (a reader sees all of a file or none of it), JSON, and the
metrics log. The bottom of the import graph: it imports nothing of redumix."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from redumix.common.ranks import rank


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same folder, fsync, then rename: readers see all of it or none of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes the file 0600; an output is as readable as the umask says
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        if exc.filename is None:  # a failed write names no file: name the one it was for
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process's umask (reading it means setting it, so it is set straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); delete it to redo the stage that wrote it") from exc


def read_json_or_none(path: Path) -> Any:
    """A JSON file's contents, or None when it is missing, unreadable or torn (a note another process may be
    writing or may have left half-written)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def log_metrics(path: Path, stage: str, **values: Any) -> None:
    """Append one JSON line to the metrics log at `path` (a run folder's logs/metrics.jsonl; rank 0 only). A line is
    one write, so a crash cannot tear it."""
    if rank() != 0:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"time": round(time.time(), 3), "stage": stage, **values}) + "\n"
    with open(path, "a") as f:
        f.write(line)
