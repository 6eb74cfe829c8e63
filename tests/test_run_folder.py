"""The run folder's promises off the happy path: one writer at a time, outputs as readable as the umask says."""

from __future__ import annotations

import json
import os
import socket
import stat

import pytest

from redumix.common.files import atomic_write_text
from redumix.pipeline.lock import HOLDER_NAME, RunFolderBusy, run_folder_lock
from tests.conftest import rows_differ


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


def test_temporary_files_a_killed_run_left_are_removed_by_the_next_holder(tmp_path, capsys):
    """A process SIGKILLed between an atomic write's temporary file and its rename leaves `.NAME.XXXX.tmp` (train: a
    `.saved.tmp/` folder); nothing else would ever remove it. The next process to hold the folder's lock does."""
    import tempfile

    (tmp_path / "harvest").mkdir()
    fd, left = tempfile.mkstemp(prefix=".shard-00003.arrow.", suffix=".tmp", dir=tmp_path / "harvest")
    os.write(fd, b"half a shard")
    os.close(fd)
    (tmp_path / "train" / ".saved.tmp").mkdir(parents=True)
    (tmp_path / "train" / ".saved.tmp" / "model.safetensors").write_bytes(b"half a model")
    kept = [tmp_path / "harvest" / "shard-00000.arrow", tmp_path / ".base.partial" / "checkpoint" / "state.json"]
    for path in kept:  # finished files, and a base build's resume state, stay
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
    with run_folder_lock(tmp_path, "harvest"):
        assert not os.path.exists(left) and not (tmp_path / "train" / ".saved.tmp").exists()
        assert all(path.exists() for path in kept)
    assert f"removed 2 temporary file(s) that a stopped run left in {tmp_path}" in capsys.readouterr().out


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_outputs_are_as_readable_as_the_umask_says(tmp_path, mask, mode):
    before = os.umask(mask)
    try:
        atomic_write_text(tmp_path / "report.json", "{}")
    finally:
        os.umask(before)
    assert stat.S_IMODE((tmp_path / "report.json").stat().st_mode) == mode


def test_train_and_export_made_from_an_old_harvest_are_redone_after_a_reharvest(tmp_path, capsys):
    """The advice in docs/robustness.md (delete harvest/, harvest again) must not leave train/ and export/ from the
    old rows."""
    import shutil

    from redumix.pipeline.config import load_config
    from redumix.pipeline.export import run_export
    from redumix.pipeline.lineage import harvest_id
    from redumix.pipeline.run import RunDir
    from redumix.pipeline.train import run_train
    from tests.train_fixtures import write_base, write_harvest

    run = RunDir(tmp_path / "run")
    write_base(run.embedded)
    write_harvest(run.harvest, n_rows=24, length=12, seed=0)
    settings = [f"model.path={run.embedded}", "train.batch_size=4", "train.max_steps=2", "train.warmup_ratio=0.0",
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


def test_eval_reports_which_harvest_and_train_output_it_measured(tmp_path, tiny_model_dir):
    from redumix.pipeline.config import load_config
    from redumix.pipeline.eval import run_eval
    from redumix.pipeline.lineage import model_id
    from redumix.pipeline.run import RunDir

    config = load_config(ROOT / "recipes" / "tiny.yaml", [f"model.path={tiny_model_dir}", *SMALL, "eval.n=2",
                                                          "eval.decoders=[greedy]", "eval.checkpoints=[base]"])
    run_eval(config, RunDir(tmp_path))
    inputs = json.loads((tmp_path / "eval" / "report.json").read_text())["inputs"]
    assert inputs == {"harvest": None, "train": None, "models": {"base": model_id(tiny_model_dir)}}


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


ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
SMALL = ["harvest.n=8", "harvest.shard_rows=2", "harvest.batch_size=2", "sampling.max_new_tokens=6",
         "sampling.temperature=1.0", "redumix.reflection_max_tokens=6", "redumix.topk=8"]


def _harvest_command(run_dir, model_dir, *extra):
    import sys

    return [sys.executable, "-m", "redumix.pipeline.cli", "harvest", "--recipe", str(ROOT / "recipes" / "tiny.yaml"),
            "--run-dir", str(run_dir), f"model.path={model_dir}", *SMALL, *extra]


def _rows(run_dir):
    from redumix.data.shards import iter_rows, shard_paths

    return [{k: v for k, v in r.items() if k != "meta"} for r in iter_rows(shard_paths(run_dir / "harvest"))]


def test_ctrl_c_mid_harvest_prints_one_line_and_the_rerun_ends_with_the_same_rows(tmp_path, tiny_model_dir):
    import signal
    import subprocess
    import time

    from redumix.data.shards import shard_paths
    from redumix.pipeline.cli import main

    assert main(_harvest_command(tmp_path / "whole", tiny_model_dir)[3:]) == 0
    run_dir = tmp_path / "stopped"
    process = subprocess.Popen(_harvest_command(run_dir, tiny_model_dir), cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    while not shard_paths(run_dir / "harvest") and process.poll() is None:
        time.sleep(0.02)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    if process.returncode == 0:
        pytest.skip("the harvest finished before the signal landed")
    assert process.returncode == 130
    assert "Traceback" not in err and "interrupted" in err and "run the same command again to resume" in err
    assert main(_harvest_command(run_dir, tiny_model_dir)[3:]) == 0
    assert rows_differ(_rows(run_dir), _rows(tmp_path / "whole")) == []


def test_a_full_disk_names_the_file_it_could_not_write(tmp_path, tiny_model_dir, monkeypatch, capsys):
    import errno
    import os

    from redumix.common import files as files_module
    from redumix.pipeline.cli import main

    real = os.fdopen
    calls = []

    def full_after_two(fd, *args, **kwargs):
        handle = real(fd, *args, **kwargs)
        calls.append(fd)
        if len(calls) == 4:  # config.yaml, lock note, fingerprint.json, then the harvest's config.yaml

            def write(data):
                raise OSError(errno.ENOSPC, "No space left on device")

            handle.write = write
        return handle

    monkeypatch.setattr(files_module.os, "fdopen", full_after_two)
    assert main(_harvest_command(tmp_path / "run", tiny_model_dir)[3:]) == 1
    err = capsys.readouterr().err
    assert "no space left on the device" in err and str(tmp_path / "run") in err and "Traceback" not in err


@pytest.mark.slow
def test_two_harvests_on_one_folder_never_mix(tmp_path, tiny_model_dir):
    """Started together with different λ, ten times: one runs and the other is refused with the lock message, or the
    second starts after the first and is refused as another config. Never shards of both."""
    import json as json_module
    import subprocess

    from redumix.data.shards import iter_rows, shard_paths

    for attempt in range(10):
        run_dir = tmp_path / f"try-{attempt}"
        processes = [subprocess.Popen(_harvest_command(run_dir, tiny_model_dir, f"redumix.lam={lam}"), cwd=ROOT,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                     for lam in (0.5, 0.7)]
        results = [(p.wait(timeout=300), p.stderr.read()) for p in processes]
        codes = sorted(code for code, _ in results)
        assert codes == [0, 1], results
        refused = next(err for code, err in results if code == 1)
        assert "is in use by pid" in refused or "different config" in refused, refused
        manifest = json_module.loads((run_dir / "harvest" / "manifest.json").read_text())
        rows = list(iter_rows(shard_paths(run_dir / "harvest")))
        assert len(rows) == 8 and {round(row["lam"], 4) for row in rows} == {manifest["lam"]}
        assert {json_module.loads(row["meta"])["fingerprint"] for row in rows} == {manifest["fingerprint"]}


@pytest.mark.parametrize("damage, message", [
    ("zero-byte weights", "model.safetensors: not a readable safetensors file"),
    ("garbage tokenizer.json", "the tokenizer does not load (tokenizer.json, tokenizer_config.json: "),
    ("unknown model_type", "config.json: transformers cannot load this model config"),
])
def test_an_unreadable_model_is_one_error_and_claims_nothing(tmp_path, tiny_model_dir, capsys, damage, message):
    from redumix.pipeline.cli import main

    folder = _model_copy(tiny_model_dir, tmp_path)
    if damage == "zero-byte weights":
        (folder / "model.safetensors").write_bytes(b"")
    elif damage == "garbage tokenizer.json":
        (folder / "tokenizer.json").write_text("{garbage")
    else:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "model_type": "no-such-model"}))
    run_dir = tmp_path / "run"
    assert main(_harvest_command(run_dir, folder)[3:]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (run_dir / "harvest").exists()
    assert main(_harvest_command(run_dir, tiny_model_dir)[3:]) == 0  # the fixed rerun runs


def test_a_100k_character_question_is_refused_before_any_work(tmp_path, tiny_model_dir, capsys):
    import resource

    data = tmp_path / "gsm8k"
    data.mkdir()
    lines = [{"question": "Tom has 3 apples and buys 2. How many?", "answer": "3 + 2 = 5\n#### 5"},
             {"question": "How many? " * 10_000, "answer": "#### 1"}]
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    from redumix.pipeline.cli import main

    command = _harvest_command(tmp_path / "run", tiny_model_dir, "task.name=gsm8k", f"task.gsm8k.path={data}",
                               "harvest.n=2")[3:]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert main(command) == 1
    err = capsys.readouterr().err
    assert "1 prompt(s) do not fit the model's window of 2048 positions" in err and "gsm8k-train-" in err
    assert not (tmp_path / "run" / "harvest").exists()
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 2048


class _FixedTask:
    """`echo`'s examples, graded always right or always wrong, or with no examples at all: the edges of a report."""

    def __init__(self, verdict: bool, empty: bool = False) -> None:
        from tests.test_seams import EchoTask

        self.echo, self.verdict, self.empty, self.name = EchoTask(), verdict, empty, "fixed"

    def examples(self, split, n):
        return [] if self.empty else self.echo.examples(split, n)

    def answer(self, text):
        return self.echo.answer(text)

    def is_correct(self, text, example):
        return self.verdict

    def feedback(self, text, example):
        return "right" if self.verdict else "wrong"


def _strict_json(path):
    def refuse(constant):
        raise AssertionError(f"{path} holds {constant}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.mark.parametrize("case, overrides, task", [
    ("0%, n=1", ["eval.n=1", "eval.n_other=1"], (False, False)),
    ("100%", ["eval.n=3", "eval.n_other=2"], (True, False)),
    # n = 4: the Wilson bound of 100% rounded a hair inside its point, and the plot's error bar was negative
    ("100%, n=4", ["eval.n=4", "eval.n_other=4"], (True, False)),
    ("0%, n=4", ["eval.n=4", "eval.n_other=4"], (False, False)),
    ("no held-out examples", ["eval.n=3", "eval.n_other=2"], (True, True)),
    ("no decoders", ["eval.decoders=[]", "eval.n=3"], (True, False)),
])
def test_a_report_at_the_edges_is_complete_and_strict_json(tmp_path, tiny_model_dir, case, overrides, task):
    from redumix.pipeline.config import load_config
    from redumix.pipeline.eval import run_eval
    from redumix.pipeline.run import RunDir

    decoders = [] if "eval.decoders=[]" in overrides else ["eval.decoders=[greedy, redumix-oracle]"]
    config = load_config(ROOT / "recipes" / "tiny.yaml", [f"model.path={tiny_model_dir}", *SMALL, *decoders,
                                                          *overrides, "eval.checkpoints=[base]"])
    run_eval(config, RunDir(tmp_path), task=_FixedTask(*task))
    report = _strict_json(tmp_path / "eval" / "report.json")
    markdown = (tmp_path / "eval" / "report.md").read_text()
    assert (tmp_path / "eval" / "accuracy_vs_fpe.png").stat().st_size > 0
    assert "nan" not in markdown.lower()
    for row in report["rows"]:
        if row["n"] == 0:
            assert row["accuracy"] is None and "undefined" in markdown
        else:
            assert row["accuracy"] == (1.0 if task[0] else 0.0)
    if "eval.decoders=[]" in overrides:
        assert report["rows"] == [] and "no decoder ran" in markdown.lower()


def test_a_plot_that_fails_is_a_warning_and_the_report_is_whole(tmp_path, tiny_model_dir, capsys):
    """The report comes first: a plot that cannot be written (here its path is a folder) leaves report.json and
    report.md whole, and the next eval, finding the report complete, draws the missing plot."""
    from redumix.pipeline.config import load_config
    from redumix.pipeline.eval import run_eval
    from redumix.pipeline.run import RunDir

    config = load_config(ROOT / "recipes" / "tiny.yaml", [f"model.path={tiny_model_dir}", *SMALL, "eval.n=4",
                                                          "eval.n_other=4", "eval.decoders=[greedy]",
                                                          "eval.checkpoints=[base]"])
    plot = tmp_path / "eval" / "accuracy_vs_fpe.png"
    plot.mkdir(parents=True)
    run_eval(config, RunDir(tmp_path), task=_FixedTask(True))
    out = capsys.readouterr().out
    assert f"eval: warning: the plot {plot} was not drawn (IsADirectoryError" in out
    assert _strict_json(tmp_path / "eval" / "report.json")["rows"][0]["accuracy"] == 1.0
    assert "| base | greedy |" in (tmp_path / "eval" / "report.md").read_text()
    plot.rmdir()
    run_eval(config, RunDir(tmp_path), task=_FixedTask(True))
    assert "eval: complete" in capsys.readouterr().out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_two_trainings_on_one_folder_never_mix(tmp_path):
    """Started together with different learning rates, ten times: one trains and the other is refused with the lock
    message, or finds the first one's complete output. train/ always holds one run's config and weights."""
    import subprocess
    import sys

    import yaml

    from tests.train_fixtures import write_base, write_harvest

    recipe = tmp_path / "train-only.yaml"
    recipe.write_text("name: train-only\n")
    for attempt in range(10):
        run = tmp_path / f"try-{attempt}"
        write_base(run / "base")
        write_harvest(run / "harvest", n_rows=16, length=8)
        processes = [subprocess.Popen(
            [sys.executable, "-m", "redumix.pipeline.cli", "train", "--recipe", str(recipe), "--run-dir", str(run),
             f"model.path={run / 'base'}", "train.max_steps=2", "train.batch_size=4", f"train.learning_rate={lr}"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for lr in (0.001, 0.002)]
        results = [(p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for p in processes]
        trained = [i for i, (code, out, _) in enumerate(results) if code == 0 and "already complete" not in out]
        assert len(trained) == 1, results
        other = results[1 - trained[0]]
        assert (other[0] == 1 and "is in use by pid" in other[2]) or (other[0] == 0 and "already complete" in other[1])
        saved = yaml.safe_load((run / "train" / "config.yaml").read_text())
        assert saved["train"]["learning_rate"] == (0.001, 0.002)[trained[0]]
        assert json.loads((run / "train" / "metrics.json").read_text())["steps"] == 2
