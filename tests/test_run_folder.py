"""The run folder's promises off the happy path: one writer at a time, outputs as readable as the umask says."""

from __future__ import annotations

import json
import os
import socket
import stat

import pytest

from redumix.pipeline.lock import HOLDER_NAME, RunFolderBusy, run_folder_lock
from redumix.pipeline.run import atomic_write_text


def test_a_second_writer_is_refused_with_who_holds_the_folder(tmp_path):
    with run_folder_lock(tmp_path, "harvest"):
        with pytest.raises(RunFolderBusy) as caught:
            with run_folder_lock(tmp_path, "train"):
                pass
    message = str(caught.value)
    assert f"pid {os.getpid()} on {socket.gethostname()} (harvest stage, since " in message
    assert "another --run-dir" in message
    assert not (tmp_path / HOLDER_NAME).exists()  # released: the note goes with the lock
    with run_folder_lock(tmp_path, "train"):  # and the folder is free again
        pass


def test_a_lock_left_by_a_dead_process_is_taken_over_and_said_so(tmp_path, capsys):
    # A SIGKILLed holder leaves its note; the kernel has already freed its lock.
    (tmp_path / HOLDER_NAME).write_text(json.dumps({"pid": 999999, "host": "elsewhere", "stage": "eval",
                                                    "since": "2026-01-01 00:00:00"}))
    with run_folder_lock(tmp_path, "eval"):
        holder = json.loads((tmp_path / HOLDER_NAME).read_text())
        assert holder["pid"] == os.getpid() and holder["stage"] == "eval"
    out = capsys.readouterr().out
    assert "took over the lock" in out and "pid 999999 on elsewhere (eval stage" in out


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_outputs_are_as_readable_as_the_umask_says(tmp_path, mask, mode):
    before = os.umask(mask)
    try:
        atomic_write_text(tmp_path / "report.json", "{}")
    finally:
        os.umask(before)
    assert stat.S_IMODE((tmp_path / "report.json").stat().st_mode) == mode
