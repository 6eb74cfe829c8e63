"""The run folder, atomic file writes, rank-aware printing and the metrics log. No maths here."""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def base(self) -> Path:
        return self.root / "base"

    @property
    def harvest(self) -> Path:
        return self.root / "harvest"

    @property
    def train(self) -> Path:
        return self.root / "train"

    @property
    def eval(self) -> Path:
        return self.root / "eval"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def metrics(self) -> Path:
        return self.logs / "metrics.jsonl"


# --- ranks --------------------------------------------------------------------------------------------------------


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def print0(*args: Any, **kwargs: Any) -> None:
    if rank() == 0:
        print(*args, **kwargs, flush=True)


# --- atomic files -------------------------------------------------------------------------------------------------


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


def log_metrics(run: RunDir, stage: str, **values: Any) -> None:
    """Append one JSON line to logs/metrics.jsonl (rank 0 only). A line is one write, so a crash cannot tear it."""
    if rank() != 0:
        return
    run.logs.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"time": round(time.time(), 3), "stage": stage, **values}) + "\n"
    with open(run.metrics, "a") as f:
        f.write(line)


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (Linux reports KiB, macOS bytes)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)


def model_path(setting: str, run: RunDir) -> Path:
    """'base' names the embedded default in the run folder; anything else is a local model folder."""
    return run.base if setting == "base" else Path(setting)


# --- processes ----------------------------------------------------------------------------------------------------


def init_distributed() -> None:
    """Join the process group when launched with several ranks (torchrun / accelerate); gloo works on CPU."""
    import torch.distributed as dist

    if world_size() > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if _cuda() else "gloo")


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
