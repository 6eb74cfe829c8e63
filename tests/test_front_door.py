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


# --- the front door: a refusal changes nothing, a Hub id and TRL's spellings get the redumix form, help for users ---

RECIPE = str(ROOT / "recipes" / "tiny.yaml")
HARVEST = ["harvest.n=2", "harvest.shard_rows=2", "harvest.batch_size=2", "sampling.max_new_tokens=4",
           "redumix.reflection_max_tokens=4", "redumix.topk=8"]


def tree(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder`: a file with its bytes, a folder as None."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def redumix(capsys, *argv: str) -> tuple[int, str, str]:
    """`redumix ARGV` in-process: (exit code, stdout, stderr)."""
    from redumix.pipeline.cli import main

    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's --help and usage errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_harvest_refused_for_a_changed_setting_changes_nothing(tmp_path, tiny_model_dir, capsys):
    run = tmp_path / "run"
    command = ["harvest", "--recipe", RECIPE, "--run-dir", str(run), f"model.path={tiny_model_dir}", *HARVEST]
    assert redumix(capsys, *command)[0] == 0
    before, saved = tree(tmp_path), (run / "config.yaml").stat().st_mtime_ns
    code, _, err = redumix(capsys, *command, "redumix.lam=0.7")
    assert code == 1 and "made with a different config" in err and "redumix.lam: 0.5 -> 0.7" in err
    assert tree(tmp_path) == before  # config.yaml still the harvest's, byte for byte; the lock as it was
    assert (run / "config.yaml").stat().st_mtime_ns == saved
    assert yaml.safe_load((run / "config.yaml").read_text())["redumix"]["lam"] == 0.5


@pytest.mark.parametrize("earlier", [False, True], ids=["no run folder yet", "an earlier run's folder"])
def test_a_failed_preflight_leaves_the_folder_as_it_was(tmp_path, tiny_model_dir, capsys, monkeypatch, earlier):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "model.safetensors").write_bytes(b"")  # the folder is there; its weights do not read
    monkeypatch.chdir(tmp_path)
    if earlier:
        (tmp_path / "runs" / "tiny").mkdir(parents=True)
        (tmp_path / "runs" / "tiny" / "config.yaml").write_text("name: tiny\nseed: 7\n")
    before = tree(tmp_path)
    code, _, err = redumix(capsys, "harvest", "--recipe", RECIPE, f"model.path={model}", *HARVEST)
    assert code == 1 and "model.safetensors: not a readable safetensors file" in err
    assert tree(tmp_path) == before  # no runs/tiny/config.yaml, no .redumix.lock, no runs/ where there was none


def test_a_stage_that_wrote_something_keeps_its_config_beside_it(tmp_path):
    from redumix.pipeline.claim import claimed
    from redumix.pipeline.run import RunDir

    run = RunDir(tmp_path / "runs" / "x")
    with pytest.raises(KeyboardInterrupt), claimed(run, "harvest", "seed: 1\n"):
        assert run.config.read_text() == "seed: 1\n"
        raise KeyboardInterrupt  # before any output: undone, both folders it made included
    assert not (tmp_path / "runs").exists()
    with pytest.raises(RuntimeError), claimed(run, "harvest", "seed: 2\n"):
        (run.root / "harvest").mkdir()
        raise RuntimeError("stopped mid-stage")
    assert run.config.read_text() == "seed: 2\n" and (run.root / "harvest").is_dir()  # its outputs' config stays


@pytest.mark.parametrize("setting, where", [("recipe", "RECIPE"), ("override", "command line")])
def test_a_hub_id_is_told_how_to_download_it_naming_the_recipe_and_the_key(tmp_path, capsys, monkeypatch, setting,
                                                                            where):
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("extends: tiny\nmodel:\n  path: Qwen/Qwen2.5-1.5B-Instruct\n" if setting == "recipe"
                      else "extends: tiny\nseed: 3\n")
    extra = [] if setting == "recipe" else ["model.path=Qwen/Qwen2.5-1.5B-Instruct"]
    before = tree(tmp_path)
    code, _, err = redumix(capsys, "harvest", "--recipe", str(recipe), *extra)
    assert code == 2 and len(err.strip().splitlines()) == 1
    where = str(recipe) if where == "RECIPE" else where
    assert err.startswith(f"redumix: {where}: 'model.path' = 'Qwen/Qwen2.5-1.5B-Instruct' is not a folder here; if "
                          "it is a Hugging Face Hub id: redumix reads models from local folders only")
    assert "`hf download Qwen/Qwen2.5-1.5B-Instruct --local-dir models/qwen2.5-1.5b-instruct`" in err
    assert "huggingface-cli download" in err and "redumix embedded" not in err
    assert tree(tmp_path) == before


def test_a_missing_local_folder_is_not_taken_for_a_hub_id(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    code, _, err = redumix(capsys, "train", "--recipe", RECIPE, "model.path=models/mine")
    assert code == 2 and "'model.path' = 'models/mine': no such folder; set model.path to a local" in err
    assert "Hub" not in err and list(tmp_path.iterdir()) == [tmp_path / "models"]


@pytest.mark.parametrize("argv, hint", [
    (["--output_dir", "out"], "redumix: --output_dir is TRL's flag; redumix writes every stage's outputs under one "
                              "run folder: --run-dir DIR"),
    (["--per_device_train_batch_size", "8"], "redumix: --per_device_train_batch_size is TRL's name; redumix's key is "
                                             "train.batch_size: pass train.batch_size=8 after the recipe"),
    (["--num_train_epochs=3"], "redumix's key is train.epochs: pass train.epochs=3"),
    (["--gradient_accumulation_steps", "4"], "redumix's key is train.grad_accum: pass train.grad_accum=4"),
    (["--model_name_or_path", "Qwen/Qwen2.5-1.5B-Instruct"], "pass model.path=Qwen/Qwen2.5-1.5B-Instruct"),
    (["--harvest.n"], "redumix: --harvest.n needs a value; redumix takes overrides as harvest.n=VALUE"),
    (["per_device_train_batch_size=8"], "command line: unknown key 'per_device_train_batch_size' (that is TRL's name; "
                                        "redumix's key is 'train.batch_size')"),
    (["train.num_train_epochs=3"], "unknown key 'train.num_train_epochs' (that is TRL's name; redumix's key is "
                                   "'train.epochs')"),
    (["train.gradient_accumulation_steps=4"], "(that is TRL's name; redumix's key is 'train.grad_accum')"),
    (["model_name_or_path=x"], "(that is TRL's name; redumix's key is 'model.path')"),
])
def test_trl_habits_get_one_line_naming_the_redumix_form(tmp_path, capsys, argv, hint):
    code, _, err = redumix(capsys, "train", "--recipe", RECIPE, "--run-dir", str(tmp_path / "run"), *argv)
    assert code == 2 and hint in err
    assert "known:" not in err and "Traceback" not in err  # not a list of 40 keys
    assert len([line for line in err.splitlines() if line != "redumix: invalid config:"]) == 1
    assert not (tmp_path / "run").exists()


def test_trl_habits_in_a_recipe_name_the_file_and_the_redumix_key(tmp_path):
    from redumix.pipeline.config import load_config
    from redumix.pipeline.resolve import ConfigError

    recipe = tmp_path / "mine.yaml"
    recipe.write_text("extends: tiny\ntrain:\n  num_train_epochs: 3\n  per_device_train_batch_size: 4\n")
    with pytest.raises(ConfigError) as error:
        load_config(recipe)
    assert str(error.value).splitlines()[1:] == [
        f"  {recipe}: unknown key 'train.num_train_epochs' (that is TRL's name; redumix's key is 'train.epochs')",
        f"  {recipe}: unknown key 'train.per_device_train_batch_size' (that is TRL's name; redumix's key is "
        "'train.batch_size')"]


def test_trl_config_flag_and_dotted_flags_work():
    from redumix.pipeline.cli import parse_args

    args = parse_args(["harvest", "--config", "my.yaml", "--harvest.n", "8", "--redumix.lam=0.7",
                       "--sampling.temperature", "-1", "seed=3"])
    assert args.recipe == "my.yaml"
    assert args.overrides == ["harvest.n=8", "redumix.lam=0.7", "sampling.temperature=-1", "seed=3"]
    assert parse_args(["--config", "my.yaml", "eval", "--eval.n", "5"]).overrides == ["eval.n=5"]


def test_help_speaks_to_users_and_a_bare_redumix_needs_no_overrides(capsys):
    code, out, _ = redumix(capsys, "--help")
    assert code == 0 and "Makefile" not in out
    assert "redumix STAGE [--recipe R] [--run-dir DIR] [-v] [key.sub=value ...]" in out
    assert "Any key.sub=value after it changes that key; none is needed." in " ".join(out.split())
    code, bare, err = redumix(capsys)
    assert code == 0 and bare == out and "required" not in bare + err
    code, _, err = redumix(capsys, "--recipe", "tiny")  # no stage: it says to name one, and nothing of overrides
    assert code == 2 and "name a stage, one of: embedded, harvest" in err and "overrides" not in err.splitlines()[-1]


def test_stage_help_shows_the_stage_s_own_keys_first(capsys):
    code, out, _ = redumix(capsys, "harvest", "--help")
    keys = out.split("config keys it reads", 1)[1].splitlines()[1:]
    assert code == 0 and keys[:2] == ["harvest:", "  harvest.n = 3000  (int)"]
    assert not [line for line in keys if line.startswith("  embedded.")]  # one line for the embedded model's build
    assert keys[-1].startswith("embedded.*: ") and keys[-1].endswith("`redumix embedded --help` lists them")
    _, out, _ = redumix(capsys, "embedded", "--help")
    assert out.split("config keys it reads", 1)[1].splitlines()[1:3] == ["embedded:", "  embedded.steps = 3500  (int)"]


def test_make_asks_the_stage_table_even_before_the_venv_exists(tmp_path, capsys):
    """`make help` in a checkout with no .venv and no redumix installed: its stage list comes from
    pipeline/stages.py run by the Python that will build the venv; `redumix stages` says the same."""
    import ast
    import sys

    from redumix.pipeline.stages import STAGES

    source = (ROOT / "pipeline" / "stages.py").read_text()
    imported = {a.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Import) for a in node.names}
    imported |= {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}
    assert "sed" not in (ROOT / "Makefile").read_text().split("STAGES :=", 1)[1].splitlines()[0]
    (tmp_path / "pipeline").mkdir()
    shutil.copy2(ROOT / "pipeline" / "stages.py", tmp_path / "pipeline" / "stages.py")
    shutil.copy2(ROOT / "Makefile", tmp_path / "Makefile")
    python = shutil.which("python3") or sys.executable
    done = subprocess.run(["make", "-s", "--no-print-directory", "help", f"PYTHON={python}"], cwd=tmp_path,
                          capture_output=True, text=True, check=True)
    assert f"STAGE is one of: {' '.join(STAGES)}" in done.stdout and not (tmp_path / ".venv").exists()
    assert "(on NPROC ranks through torchrun: harvest train eval rounds)" in done.stdout
    assert redumix(capsys, "stages", "--names")[1].split() == list(STAGES)
    assert redumix(capsys, "stages", "--ranked")[1].split() == ["harvest", "train", "eval", "rounds"]
