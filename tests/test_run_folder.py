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


def test_train_and_export_made_from_an_old_harvest_are_redone_after_a_reharvest(tmp_path, capsys):
    """The README's advice (delete harvest/, harvest again) must not leave train/ and export/ from the old rows."""
    import shutil

    from redumix.pipeline.config import load_config
    from redumix.pipeline.export import run_export
    from redumix.pipeline.lineage import harvest_id
    from redumix.pipeline.run import RunDir
    from redumix.pipeline.train import run_train
    from tests.train_fixtures import write_base, write_harvest

    run = RunDir(tmp_path / "run")
    write_base(run.base)
    write_harvest(run.harvest, n_rows=24, length=12, seed=0)
    settings = [f"model.path={run.base}", "train.batch_size=4", "train.max_steps=2", "train.warmup_ratio=0.0",
                "train.save_steps=1", "train.heldout_fraction=0.2"]
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\n")
    config = load_config(recipe, settings)
    first = run_train(config, run)
    first_export = run_export(config, run)
    assert run_train(config, run) == first  # unchanged inputs: complete, skipped
    capsys.readouterr()

    shutil.rmtree(run.harvest)
    write_harvest(run.harvest, n_rows=24, length=12, seed=1)  # another harvest, with as many rows
    second = run_train(config, run)
    out = capsys.readouterr().out
    assert "was made from another harvest" in out and "already complete" not in out
    assert second["inputs"]["harvest"] == harvest_id(run.harvest) != first["inputs"]["harvest"]
    second_export = run_export(config, run)
    assert "was made from another harvest" in capsys.readouterr().out
    assert second_export["inputs"] != first_export["inputs"]
    assert run_train(config, run) == second and "already complete" in capsys.readouterr().out
