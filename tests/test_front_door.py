"""The README's own-model steps, run as written: `redumix config --recipe R --name my-run ... > my-run.yaml`, then
`make harvest train eval RECIPE=my-run.yaml`. The run folder is the user's, `runs/my-run/`, never the bundled
recipe's, and the written recipe holds only what differs from R, under the user's name."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
# The sizes a user would edit into the written recipe for a first, small try ("edit it freely", the README says).
SMALL = {"sampling": {"max_new_tokens": 6}, "redumix": {"reflection_max_tokens": 5, "critique_max_tokens": 4},
         "harvest": {"n": 4, "batch_size": 2, "shard_rows": 2},
         "train": {"adapter": "full", "max_steps": 1, "batch_size": 2, "save_steps": 1, "logging_steps": 1},
         "eval": {"n": 2, "n_other": 2, "batch_size": 2, "decoders": ["greedy"], "tuned_decoders": ["greedy"]}}


def readme_steps() -> list[str]:
    """The commands of the README's "Run your own model" code block, comments dropped."""
    section = (ROOT / "README.md").read_text().split("## Run your own model", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


@pytest.mark.slow  # three stages as subprocesses through make: about a minute
def test_the_readme_own_model_steps_make_the_user_s_run_folder(tmp_path, tiny_model_dir):
    config_step, make_step = readme_steps()
    assert "--name my-run" in config_step and config_step.endswith("> my-run.yaml")
    assert make_step == "make harvest train eval RECIPE=my-run.yaml"
    # The folder a user runs from: the checkout's Makefile and packages (links), so that runs/ is this test's own.
    for name in ("pipeline", "recipes", "models", ".venv"):
        (tmp_path / name).symlink_to(ROOT / name)
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy2(ROOT / name, tmp_path / name)  # copy2 keeps the mtime: make sees .venv as installed

    command, _, target = config_step.partition(" > ")
    argv = [a.replace("/models/my-chat-model", str(tiny_model_dir)) for a in shlex.split(command)]
    written = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    recipe = yaml.safe_load(written)
    assert recipe == {"extends": "smollm2-135m-arith", "name": "my-run", "model": {"path": str(tiny_model_dir)}}
    recipe.update(SMALL)  # the user's edit
    (tmp_path / target).write_text(yaml.safe_dump(recipe, sort_keys=False))

    done = subprocess.run(shlex.split(make_step), cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "runs" / "my-run"
    assert (run / "harvest" / "manifest.json").is_file() and (run / "train" / "metrics.json").is_file()
    assert (run / "eval" / "report.json").is_file()
    assert not (tmp_path / "runs" / "smollm2-135m-arith").exists()
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["name"] == "my-run" and saved["task"]["arith"]["steps_max"] == 3  # the extended recipe's setting
