"""One writer per run folder.

Every stage the CLI starts holds `RUN_DIR/.redumix.lock` (an OS file lock, through `filelock`) for its whole run,
so two processes can never interleave shards, checkpoints or reports in one folder. Beside the lock,
`.redumix.lock.json` says who holds it: pid, host, stage and since when. The kernel frees the lock of a process that
dies however it dies (SIGKILL included), so a stale lock needs no clean-up by hand: the next run takes it, finds the
dead holder's note and says that it took the lock over. Holding the lock, it also removes the temporary files
(`.NAME.*.tmp`, `.saved.tmp/`) that a process killed in the middle of an atomic write left: no one else can be
writing them. Under torchrun, rank 0 takes the lock and every rank learns whether it did, so all ranks run or none
does.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from redumix.common.files import atomic_write_json, read_json_or_none
from redumix.common.ranks import print0, rank, world_size

LOCK_NAME = ".redumix.lock"
HOLDER_NAME = ".redumix.lock.json"


class RunFolderBusy(RuntimeError):
    """Another process holds the run folder's lock."""


@contextmanager
def run_folder_lock(root: Path, stage: str) -> Iterator[None]:
    """Hold `root`'s lock while the body runs, or raise RunFolderBusy naming the holder and what to do."""
    ours = rank() == 0
    lock = FileLock(str(Path(root) / LOCK_NAME)) if ours else None
    taken = _acquire(lock, Path(root), stage) if ours else False
    if not _all_ranks_agree(taken):
        if ours and taken:
            lock.release()
        raise RunFolderBusy(_busy_message(Path(root), _wait_for_holder(Path(root) / HOLDER_NAME)) if ours else "")
    try:
        yield
    finally:
        if ours:
            (Path(root) / HOLDER_NAME).unlink(missing_ok=True)
            lock.release()


def _acquire(lock: FileLock, root: Path, stage: str) -> bool:
    root.mkdir(parents=True, exist_ok=True)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return False
    holder_path = root / HOLDER_NAME
    stale = read_json_or_none(holder_path)  # written by a process that held this lock and died without releasing it
    if stale:
        print0(f"redumix: took over the lock of {root} left by {_describe(stale)}, which is no longer running; "
               "its stage resumes from what it wrote")
    removed = remove_temporaries(root)
    if removed:
        print0(f"redumix: removed {len(removed)} temporary file(s) that a stopped run left in {root}: "
               f"{', '.join(str(p.relative_to(root)) for p in removed[:3])}{' ...' if len(removed) > 3 else ''}")
    atomic_write_json(holder_path, {"pid": os.getpid(), "host": socket.gethostname(), "stage": stage,
                                    "since": time.strftime("%Y-%m-%d %H:%M:%S")})
    return True


def remove_temporaries(root: Path) -> list[Path]:
    """Delete every `.*.tmp` file or folder under `root` (what an atomic write or a save under a temporary name leaves
    when its process is killed before the rename); call it holding the lock. Returns what it removed."""
    found = sorted(p for p in root.rglob(".*.tmp") if not any(parent.name.endswith(".tmp") for parent in
                                                               p.relative_to(root).parents))
    for path in found:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return found


def _all_ranks_agree(taken: bool) -> bool:
    """Rank 0's answer, given to every rank (a single process answers itself)."""
    if world_size() == 1:
        return taken
    import torch
    import torch.distributed as dist

    from redumix.common.ranks import init_distributed

    init_distributed()
    flag = torch.tensor([int(taken)])
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def _wait_for_holder(path: Path, seconds: float = 2.0) -> dict | None:
    """The holder's note, which it writes just after it takes the lock: a refusal can land in between."""
    deadline = time.time() + seconds
    while (holder := read_json_or_none(path)) is None and time.time() < deadline:
        time.sleep(0.05)
    return holder


def _describe(holder: dict) -> str:
    return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} ({holder.get('stage', '?')} stage, "
            f"since {holder.get('since', '?')})")


def _busy_message(root: Path, holder: dict | None) -> str:
    who = _describe(holder) if holder else "another process"
    return (f"{root} is in use by {who}; wait for it to finish (or stop it), or pass another --run-dir. "
            "Two processes writing one run folder would mix their outputs")
