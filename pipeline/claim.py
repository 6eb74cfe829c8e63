"""A stage's claim on its run folder: the lock, and the resolved config saved there as `config.yaml`.

The config is saved before the stage starts, so that whatever it writes, even if it is stopped, has its config
beside it. A stage that ends before writing anything (refused for a changed setting, a model that does not load, a
prompt that does not fit, Ctrl-C during those checks) leaves the folder exactly as it was: `config.yaml` as before,
no lock file it made, and no folder at all where there was none. Whether it wrote anything is read from the folder
itself (every path, size and modification time, before and after), so no stage has to report it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from redumix.common.files import atomic_write_text
from redumix.common.ranks import rank
from redumix.pipeline.lock import LOCK_NAME, run_folder_lock
from redumix.pipeline.run import RunDir


@contextmanager
def claimed(run: RunDir, stage: str, config_yaml: str) -> Iterator[None]:
    """Hold `run`'s lock with `config_yaml` saved as its config.yaml while the body runs; undo both if the body
    raises having written nothing else."""
    if rank() != 0:  # rank 0 writes and undoes; the others only take part in the lock
        with run_folder_lock(run.root, stage):
            yield
        return
    made = [p for p in (run.root, *run.root.parents) if not p.exists()]  # the folders it creates, deepest first
    lock_was_there = (run.root / LOCK_NAME).exists()
    run.root.mkdir(parents=True, exist_ok=True)
    untouched = False
    try:
        with run_folder_lock(run.root, stage):
            before = listing(run.root)
            previous = run.config.read_bytes() if run.config.is_file() else None
            previous_stat = run.config.stat() if previous is not None else None
            atomic_write_text(run.config, config_yaml)
            try:
                yield
            except BaseException:
                untouched = listing(run.root) == before
                if untouched:
                    restore(run.config, previous, previous_stat)
                raise
    finally:
        if untouched:  # after the lock's release, which removes its note
            remove_if_empty(None if lock_was_there else run.root / LOCK_NAME, made)


def listing(root: Path) -> dict[str, tuple[bool, int, int]]:
    """Every path under `root` but config.yaml and the lock file: (is a folder, size, modification time in ns)."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            relative = str(path.relative_to(root))
            if relative in ("config.yaml", LOCK_NAME):
                continue
            stat = path.lstat()
            found[relative] = (name in dirs, stat.st_size if name in files else 0, stat.st_mtime_ns)
    return found


def restore(path: Path, previous: bytes | None, stat: os.stat_result | None) -> None:
    """Put a file back as it was (bytes, mode and times), or remove it if there was none."""
    if previous is None or stat is None:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(f".{path.name}.restore.tmp")  # a kill in between leaves a temporary the next lock removes
    tmp.write_bytes(previous)
    os.chmod(tmp, stat.st_mode)
    os.utime(tmp, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(tmp, path)


def remove_if_empty(lock: Path | None, made: list[Path]) -> None:
    """Remove the lock file this claim made, then the folders it made, each only while nothing else is in it."""
    if lock is not None:
        lock.unlink(missing_ok=True)
    for folder in made:
        try:
            folder.rmdir()
        except OSError:  # not empty: someone else's now, or written by another process meanwhile
            return
