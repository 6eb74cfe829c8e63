"""Security: model code runs only when a recipe turns trust_remote_code on, and nothing read back is unpickled."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from redumix.generate.model_io import ModelConfig, load_model

ROOT = Path(__file__).resolve().parents[1]
MARKER = "this code ran"


def _model_that_ships_code(folder: Path, tiny_model_dir: Path) -> Path:
    """The tiny model's files plus an `auto_map` that points at a Python file in the folder."""
    folder.mkdir()
    for path in tiny_model_dir.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    (folder / "custom_config.py").write_text(
        f"raise RuntimeError({MARKER!r})\n"  # importing it at all is the failure
    )
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "custom_config.CustomConfig"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_model_folder_that_ships_code_is_refused_without_trust_remote_code(tmp_path, tiny_model_dir):
    folder = _model_that_ships_code(tmp_path / "shipped", tiny_model_dir)
    with pytest.raises(Exception) as refused:
        load_model(folder, ModelConfig(trust_remote_code=False))
    assert MARKER not in str(refused.value)  # the shipped code never ran
    assert "trust_remote_code" in str(refused.value)
    with pytest.raises(RuntimeError, match=MARKER):  # it is only run when the recipe says so
        load_model(folder, ModelConfig(trust_remote_code=True))


def test_no_library_code_unpickles_without_weights_only():
    """Every torch.load in the library restricts itself to tensors and plain values."""
    calls = []
    for path in [*ROOT.glob("pipeline/*.py"), *ROOT.glob("train/*.py"), *ROOT.glob("generate/*.py"),
                 *ROOT.glob("data/*.py"), *ROOT.glob("embedded/*.py")]:
        for line_no, line in enumerate(path.read_text().splitlines(), start=1):
            if re.search(r"\btorch\.load\(|\bpickle\.loads?\(", line):
                calls.append((path.name, line_no, "weights_only=True" in line))
    assert calls and all(safe for _, _, safe in calls), calls


@pytest.mark.parametrize("name", ["../../outside", "a/b", "..", "/tmp/x"])
def test_a_recipe_name_cannot_point_the_run_folder_outside_runs(name):
    from redumix.pipeline.config import load_config
    from redumix.pipeline.resolve import ConfigError

    with pytest.raises(ConfigError, match=r"'name'.*--run-dir"):
        load_config(ROOT / "recipes" / "tiny.yaml", [f"name={name}"])
    assert load_config(ROOT / "recipes" / "tiny.yaml", ["name=tiny-v2.1"]).name == "tiny-v2.1"


MARKERS = ("<|reflect|>", "<|/reflect|>")


def test_markers_never_reach_logs_reports_or_exports(tmp_path, tiny_model_dir, capfd):
    """Harvest, export and eval on a model whose markers are real tokens, with reflections forced in eval and the
    harvest sampled at temperature 1: no marker string in any output file, record, shard text or printed line."""
    from redumix.data.shards import iter_rows, shard_paths
    from redumix.pipeline.config import load_config
    from redumix.pipeline.eval import run_eval
    from redumix.pipeline.export import run_export
    from redumix.pipeline.harvest import run_harvest
    from redumix.pipeline.run import RunDir

    config = load_config(ROOT / "recipes" / "tiny.yaml", [
        f"model.path={tiny_model_dir}", "harvest.n=12", "harvest.shard_rows=4", "harvest.batch_size=4",
        "sampling.temperature=1.0", "sampling.max_new_tokens=12", "redumix.reflection_max_tokens=8",
        "redumix.critique_max_tokens=6", "redumix.topk=8", "eval.n=6", "eval.n_other=6", "eval.batch_size=3",
        "eval.checkpoints=[base]", "eval.decoders=[greedy,sample,redumix-oracle,reflective,reflective-random]",
        # Every visible step may open a span (no trigger point, a gate that always fires), and spans run to length.
        "reflective.trigger_after=[]", "reflective.tau_high=-1.0", "reflective.tau_low=-1.0", "reflective.cooldown=0",
        "reflective.stop=peek", "reflective.tau_stop=-1.0", "reflective.reflect_length=3",
    ])
    run = RunDir(tmp_path / "run")
    run_harvest(config, run)
    run_export(config, run)
    run_eval(config, run)
    printed = capfd.readouterr()

    records = [json.loads(line) for path in (run.eval / "generations").glob("*.jsonl")
               for line in path.read_text().splitlines()]
    assert sum(r["extra"]["n_reflections"] for r in records if r["decoder"] == "reflective") > 0  # spans were there
    texts = {"stdout": printed.out, "stderr": printed.err}
    for path in run.root.rglob("*"):
        # config.yaml states the marker settings themselves; shards are checked by column below.
        if path.is_file() and path.name != "config.yaml" and path.suffix not in (".arrow", ".safetensors"):
            texts[str(path)] = path.read_text(errors="replace")
    for row in iter_rows(shard_paths(run.harvest)):
        texts[f"shard row {row['id']}"] = json.dumps({k: v for k, v in row.items() if isinstance(v, str)})
    assert (run.root / "export" / "dpo.jsonl").is_file() and (run.eval / "report.md").is_file()
    assert len(texts) > 12
    leaks = [(where, marker) for where, text in texts.items() for marker in MARKERS if marker in text]
    assert not leaks, leaks
