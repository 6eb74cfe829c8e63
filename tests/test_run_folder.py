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


def _model_copy(tiny_model_dir, tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    return folder


def test_a_zero_byte_weights_file_is_named(tiny_model_dir, tmp_path):
    from redumix.pipeline.preflight import check_model_files

    folder = _model_copy(tiny_model_dir, tmp_path)
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        check_model_files(folder, trust_remote_code=False)


def test_an_unknown_model_type_is_named(tiny_model_dir, tmp_path):
    from redumix.pipeline.preflight import check_model_files

    folder = _model_copy(tiny_model_dir, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "no-such-model"}))
    with pytest.raises(ValueError, match=r"config\.json: transformers cannot load this model config"):
        check_model_files(folder, trust_remote_code=False)


def test_the_window_is_read_from_the_config(tiny_model_dir):
    from redumix.pipeline.preflight import check_model_files

    assert check_model_files(tiny_model_dir, trust_remote_code=False) == 2048


def test_a_prompt_past_the_window_is_refused_naming_it(tiny_tokenizer):
    from redumix.data.task import Example
    from redumix.pipeline.preflight import check_prompts_fit

    examples = [Example("ok-1", "t", "What is 2 + 2?", "4"), Example("long-2", "t", "x" * 100_000, "1")]
    with pytest.raises(ValueError, match=r"1 prompt\(s\) do not fit the model's window of 512 .* long-2 \(100,0"):
        check_prompts_fit(tiny_tokenizer, 512, examples, max_new_tokens=64)
    check_prompts_fit(tiny_tokenizer, 512, examples[:1], max_new_tokens=64)


@pytest.mark.parametrize("device, message", [("gpu0", "is not a device torch knows"),
                                             ("cuda", "this machine has no CUDA GPU")])
def test_a_device_the_machine_lacks_is_refused(device, message):
    from redumix.pipeline.preflight import check_device

    if device == "cuda" and torch_cuda():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match=message):
        check_device(device)


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
