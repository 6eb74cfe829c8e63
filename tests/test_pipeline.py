"""The whole pipeline through the real CLI, on a miniature of the tiny recipe: base -> harvest -> train -> eval."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from redumix.data.shards import load_shards

ROOT = Path(__file__).resolve().parents[1]
MINIATURE = [
    "embedded.steps=30", "embedded.hidden_size=32", "embedded.heads=2", "embedded.layers=2",
    "embedded.intermediate_size=64",
    "embedded.eval_n=8", "embedded.eval_reflection=false", "embedded.seq_len=512",
    "harvest.n=12", "harvest.shard_rows=6", "harvest.batch_size=6",
    "sampling.max_new_tokens=24", "redumix.reflection_max_tokens=24",
    "train.epochs=1", "train.batch_size=4", "train.save_steps=2",
    "eval.n=6", "eval.n_other=3", "eval.batch_size=3", "eval.decoders=[greedy, redumix-oracle, moi, sr, reflective]",
    "eval.tuned_decoders=[]",  # the tuned checkpoint runs the same list (the recipe names a subset)
    "pdr.workspace_tokens=32",
]


def redumix(stage: str, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "redumix.pipeline.cli", stage, "--recipe", str(ROOT / "recipes" / "tiny.yaml"),
               "--run-dir", str(run_dir), *MINIATURE, *extra]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_harvest_train_eval_end_to_end(tmp_path):
    for stage in ("harvest", "train", "eval"):
        done = redumix(stage, tmp_path)
        assert done.returncode == 0, f"{stage} failed:\n{done.stderr[-3000:]}"

    config = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert config["harvest"]["n"] == 12 and config["name"] == "tiny"
    assert json.loads((tmp_path / "embedded" / "metrics.json").read_text())["n"] == 8
    manifest = json.loads((tmp_path / "harvest" / "manifest.json").read_text())
    assert manifest["rows"] == 12 and len(manifest["shards"]) == 2
    assert load_shards(tmp_path / "harvest").num_rows == 12
    assert (tmp_path / "train" / "merged" / "config.json").is_file()
    assert (tmp_path / "logs" / "metrics.jsonl").read_text().count("\n") > 3
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert {(r["checkpoint"], r["decoder"]) for r in report["rows"]} == {
        (c, d) for c in ("base", "tuned") for d in ("greedy", "redumix-oracle", "moi", "sr", "reflective")
    }

    # Every stage is complete now: rerunning says so and changes nothing.
    again = redumix("harvest", tmp_path)
    assert again.returncode == 0 and "complete" in again.stdout
