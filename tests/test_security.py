"""Security: model code runs only when a recipe turns trust_remote_code on, and nothing read back is unpickled."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from redumix.generate.model_io import load_model

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
        load_model(folder, trust_remote_code=False)
    assert MARKER not in str(refused.value)  # the shipped code never ran
    assert "trust_remote_code" in str(refused.value)
    with pytest.raises(RuntimeError, match=MARKER):  # it is only run when the recipe says so
        load_model(folder, trust_remote_code=True)


def test_no_library_code_unpickles_without_weights_only():
    """Every torch.load in the library restricts itself to tensors and plain values."""
    calls = []
    for path in [*ROOT.glob("pipeline/*.py"), *ROOT.glob("train/*.py"), *ROOT.glob("generate/*.py"),
                 *ROOT.glob("data/*.py")]:
        for line_no, line in enumerate(path.read_text().splitlines(), start=1):
            if re.search(r"\btorch\.load\(|\bpickle\.loads?\(", line):
                calls.append((path.name, line_no, "weights_only=True" in line))
    assert calls and all(safe for _, _, safe in calls), calls


@pytest.mark.parametrize("name", ["../../outside", "a/b", "..", "/tmp/x"])
def test_a_recipe_name_cannot_point_the_run_folder_outside_runs(name):
    from redumix.pipeline.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"'name'.*--run-dir"):
        load_config(ROOT / "recipes" / "tiny.yaml", [f"name={name}"])
    assert load_config(ROOT / "recipes" / "tiny.yaml", ["name=tiny-v2.1"]).name == "tiny-v2.1"
