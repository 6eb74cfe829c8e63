"""Faults survived: a stage killed at a random point, or a write that fails with a full disk, leaves no partial file
under a final name, and the rerun ends with the outputs of an uninterrupted run."""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from redumix.common import files as files_module
from redumix.common.files import atomic_write_bytes
from redumix.data.shards import iter_rows, shard_paths
from redumix.pipeline.config import load_config
from redumix.pipeline.eval import run_eval
from redumix.pipeline.harvest import run_harvest
from redumix.pipeline.run import RunDir
from tests.conftest import kill_when, rows_differ

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "harvest.n=8", "harvest.shard_rows=2", "harvest.batch_size=2", "sampling.max_new_tokens=6",
    "redumix.reflection_max_tokens=5", "redumix.critique_max_tokens=4", "redumix.topk=8", "pdr.drafts=2",
    "pdr.rounds=1", "pdr.workspace_tokens=24", "eval.batch_size=2", "eval.n=6", "eval.n_other=4",
]
TIMING = {"wall_s", "tokens_per_s"}


def _report_rows(run_dir: Path) -> list[dict]:
    rows = json.loads((run_dir / "eval" / "report.json").read_text())["rows"]
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


def _records(run_dir: Path) -> dict[str, list[dict]]:
    out = {}
    for path in sorted((run_dir / "eval" / "generations").glob("*.jsonl")):
        out[path.name] = [{k: v for k, v in json.loads(line).items() if k not in ("seconds", "model")}
                          for line in path.read_text().splitlines()]
    return out


@pytest.mark.slow
def test_a_killed_eval_resumes_to_the_same_report(tmp_path, tiny_model_dir):
    config = load_config(ROOT / "recipes" / "tiny.yaml", [f"model.path={tiny_model_dir}", *SMALL])
    run_eval(config, RunDir(tmp_path / "whole"))
    killed = tmp_path / "killed"
    command = [sys.executable, "-m", "redumix.pipeline.cli", "eval", "--recipe", str(ROOT / "recipes" / "tiny.yaml"),
               "--run-dir", str(killed), f"model.path={tiny_model_dir}", *SMALL]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    generations = killed / "eval" / "generations"
    # A decoder's record file appears after its first batch: kill inside a random decoder, later ones still to run.
    started = random.randint(1, 6)
    kill_when(process, lambda: len(list(generations.glob("*.jsonl"))) >= started)
    run_eval(config, RunDir(killed))
    assert _records(killed) == _records(tmp_path / "whole")
    assert _report_rows(killed) == _report_rows(tmp_path / "whole")


class _DiskFull:
    """Makes the n-th file write of atomic_write_bytes fail with ENOSPC, as a full disk does."""

    def __init__(self, fail_at: int) -> None:
        self.calls, self.fail_at = 0, fail_at
        self.real_fdopen = os.fdopen

    def __call__(self, fd, *args, **kwargs):
        handle = self.real_fdopen(fd, *args, **kwargs)
        self.calls += 1
        if self.calls == self.fail_at:
            def write(data):
                raise OSError(errno.ENOSPC, "No space left on device")
            handle.write = write
        return handle


def test_a_failed_write_leaves_no_file_under_its_final_name(tmp_path, monkeypatch):
    target = tmp_path / "out.json"
    monkeypatch.setattr(files_module.os, "fdopen", _DiskFull(fail_at=1))
    with pytest.raises(OSError, match="No space left"):
        atomic_write_bytes(target, b"x" * 1000)
    assert list(tmp_path.iterdir()) == []  # neither the final name nor the temporary file


def test_harvest_survives_a_full_disk_and_the_rerun_completes(tmp_path, tiny_model_dir, monkeypatch):
    config = load_config(ROOT / "recipes" / "tiny.yaml", [f"model.path={tiny_model_dir}", *SMALL])
    run_harvest(config, RunDir(tmp_path / "whole"))
    whole_rows = iter_rows(shard_paths(tmp_path / "whole" / "harvest"))
    expected = [{k: v for k, v in r.items() if k != "meta"} for r in whole_rows]

    full = tmp_path / "full"
    disk = _DiskFull(fail_at=4)  # config, fingerprint, then the first shards: a shard write fails
    monkeypatch.setattr(files_module.os, "fdopen", disk)
    with pytest.raises(OSError, match="No space left"):
        run_harvest(config, RunDir(full))
    monkeypatch.setattr(files_module.os, "fdopen", disk.real_fdopen)
    folder = full / "harvest"
    assert not (folder / "manifest.json").exists()
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
    written = shard_paths(folder)
    assert all(p.stat().st_size > 0 for p in written)
    run_harvest(config, RunDir(full))
    resumed = [{k: v for k, v in r.items() if k != "meta"} for r in iter_rows(shard_paths(folder))]
    assert rows_differ(resumed, expected) == []


@pytest.mark.slow
def test_a_killed_train_resumes_to_the_same_weights(tmp_path):
    """SIGKILL `redumix train` once a checkpoint exists; the rerun ends where an unbroken run does, to 1e-5."""
    from safetensors.torch import load_file

    from redumix.pipeline.train import run_train
    from tests.train_fixtures import write_base, write_harvest

    settings = ["train.batch_size=4", "train.learning_rate=0.005", "train.warmup_ratio=0.0", "train.max_steps=12",
                "train.save_steps=2", "train.heldout_fraction=0.2", "train.lora_rank=8", "train.lora_alpha=16",
                "train.logging_steps=1"]

    def prepared(folder: Path) -> RunDir:
        run = RunDir(folder)
        write_base(run.embedded)
        write_harvest(run.harvest, n_rows=40, length=16)
        return run

    recipe = tmp_path / "train-only.yaml"  # one config for the killed process and the in-process runs
    recipe.write_text("name: train-only\n")
    whole = prepared(tmp_path / "whole")
    expected = run_train(load_config(recipe, [f"model.path={whole.embedded}", *settings]), whole)
    killed = prepared(tmp_path / "killed")
    command = [sys.executable, "-m", "redumix.pipeline.cli", "train", "--recipe", str(recipe),
               "--run-dir", str(killed.root), f"model.path={killed.embedded}", *settings]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint = killed.train / "checkpoints" / f"checkpoint-{random.choice([2, 4, 6, 8])}"  # of 12 steps
    kill_when(process, checkpoint.exists)
    resumed = run_train(load_config(recipe, [f"model.path={killed.embedded}", *settings]), killed)
    assert resumed["steps"] == expected["steps"] == 12
    assert resumed["final_loss"] == pytest.approx(expected["final_loss"], abs=1e-5)
    a = load_file(str(whole.train / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(killed.train / "adapter" / "adapter_model.safetensors"))
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


@pytest.mark.slow
def test_killed_rounds_resume_to_the_same_rounds(tmp_path, tiny_model_dir):
    """SIGKILL `redumix rounds` somewhere in its two rounds; the rerun ends with the rows, weights (to 1e-5), records
    and summary of an unbroken run."""
    from safetensors.torch import load_file

    from redumix.pipeline.studies.rounds import run_rounds

    settings = [f"model.path={tiny_model_dir}", *SMALL, "harvest.n=6", "sampling.temperature=1.0",
                "train.adapter=full", "train.max_steps=3", "train.batch_size=2", "train.save_steps=1",
                "train.heldout_fraction=0.34", "train.logging_steps=1", "rounds.count=2"]
    recipe = ROOT / "recipes" / "tiny.yaml"
    whole = tmp_path / "whole"
    run_rounds(load_config(recipe, settings), RunDir(whole))
    killed = tmp_path / "killed"
    command = [sys.executable, "-m", "redumix.pipeline.cli", "rounds", "--recipe", str(recipe),
               "--run-dir", str(killed), *settings]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # Anywhere from round 1's harvest to round 2's training, each point with a round's work or more still to do.
    one, two = (killed / "rounds" / f"round-{index}" for index in (1, 2))
    marker = random.choice([one / "harvest" / "shard-00000.arrow", one / "harvest" / "manifest.json",
                            one / "train" / "checkpoints" / "checkpoint-1", one / "eval" / "generations",
                            two / "harvest" / "shard-00001.arrow", two / "train" / "checkpoints" / "checkpoint-1"])
    kill_when(process, marker.exists)
    run_rounds(load_config(recipe, settings), RunDir(killed))

    for index in (1, 2):
        a, b = (folder / "rounds" / f"round-{index}" for folder in (whole, killed))
        rows = [[{k: v for k, v in r.items() if k != "meta"} for r in iter_rows(shard_paths(f / "harvest"))]
                for f in (a, b)]
        assert rows_differ(rows[0], rows[1]) == []  # ids and text exactly, stored floats to tolerance
        weights = [load_file(str(f / "train" / "merged" / "model.safetensors")) for f in (a, b)]
        assert all(torch.allclose(weights[0][k], weights[1][k], atol=1e-5) for k in weights[0])
        assert _records(a) == _records(b) and _report_rows(a) == _report_rows(b)

    def summary(folder: Path) -> dict:
        """rounds.json without the seconds (a resumed stage's clock is its own)."""
        rounds = json.loads((folder / "rounds" / "rounds.json").read_text().replace(str(folder), "RUN"))
        for row in rounds["rounds"][1:]:
            assert row["harvest"].pop("decode_seconds") >= 0 and row["train"].pop("wall_seconds") >= 0
        return rounds

    assert summary(killed) == summary(whole)


def test_rows_differ_holds_ids_and_text_exact_and_floats_to_their_precision():
    row = {"id": "a", "redo": "The answer is 7.", "mix_topk_ids": [[5, 9]], "mix_topk_logprobs": [[-0.5, -2.25]],
           "mix_tail_logprob": [-0.09875059]}
    assert rows_differ([row], [{**row, "mix_tail_logprob": [-0.09875107]}]) == []  # the resume case, 4.8e-7
    assert rows_differ([row], [{**row, "mix_topk_logprobs": [[-0.5, -2.2539]]}]) == []  # one float16 step
    [found] = rows_differ([row], [{**row, "mix_tail_logprob": [-0.0988]}])  # 4.9e-5: beyond float32 rounding
    assert found.startswith("a: mix_tail_logprob differs beyond its tolerance")
    assert rows_differ([row], [{**row, "mix_topk_ids": [[9, 5]]}]) == ["a: mix_topk_ids differs"]
    assert rows_differ([row], [{**row, "redo": "The answer is 8."}]) == ["a: redo differs"]
