"""The CLI explains itself: each stage's --help lists its config keys, `redumix config` prints the resolved config
or the Markdown reference (docs/config.md, kept current here), `redumix decoders` lists the decoders, `make help`
lists the targets, and recipes resolve from any directory."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from redumix.common.fingerprints import RECORD_VERSION, fingerprint
from redumix.pipeline import reference
from redumix.pipeline.cli import QUIET_ENVIRONMENT, SECTIONS, STAGES, main
from redumix.pipeline.config import load_config
from redumix.pipeline.decoders import DECODERS
from redumix.pipeline.harvest_folder import accept_folder, claim_settings
from redumix.pipeline.resolve import config_to_yaml

ROOT = Path(__file__).resolve().parents[1]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's --help and usage errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_top_level_help_lists_the_stages_and_the_commands(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for name, stage in STAGES.items():
        assert f"  {name:<10} {stage.help}" in out
    assert "config" in out and "decoders" in out and "redumix STAGE --help" in out


def test_stage_help_lists_its_sections_keys_with_defaults_and_help(capsys):
    code, out, _ = run(capsys, "harvest", "--help")
    assert code == 0
    assert out.startswith("usage: redumix harvest")
    assert '  harvest.n = 3000  (int)\n      Examples to harvest.' in out
    assert '  redumix.lam = 0.5  (float)' in out and '  seed = 0  (int)' in out
    assert "train.beta" not in out and "eval.n " not in out  # harvest reads neither section
    _, out, _ = run(capsys, "rounds", "--help")  # a stage not in SECTIONS lists every section
    for section in ("model.path", "harvest.n", "train.beta", "eval.decoders", "evidence.seeds", "embedded.*: "):
        assert section in out


@pytest.mark.parametrize("stage", sorted(SECTIONS))
def test_a_stage_module_reads_only_the_sections_its_help_lists(stage):
    """Each `config.<section>` that the stage's module reads is listed (helpers in other modules are checked by
    hand: ensure_embedded reads model, base and task)."""
    source = (ROOT / (STAGES[stage].module.removeprefix("redumix.").replace(".", "/") + ".py")).read_text()
    top = {s.dotted for s in reference.sections() if s.dotted and "." not in s.dotted}
    read = set(re.findall(r"\bconfig\.([a-z_]+)\b", source)) & top
    assert read <= set(SECTIONS[stage]), f"{stage} reads {sorted(read - set(SECTIONS[stage]))}, not in SECTIONS"


def test_config_prints_the_resolved_config_and_touches_no_run_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a bundled recipe's name resolves from any directory
    code, out, _ = run(capsys, "config", "--recipe", "tiny", "harvest.n=5", "redumix.lam=0.25")
    assert code == 0
    assert out == config_to_yaml(load_config(ROOT / "recipes" / "tiny.yaml", ["harvest.n=5", "redumix.lam=0.25"]))
    resolved = yaml.safe_load(out)
    assert resolved["name"] == "tiny" and resolved["harvest"]["n"] == 5 and resolved["redumix"]["lam"] == 0.25
    assert list(tmp_path.iterdir()) == []  # no runs/, no lock, no config.yaml
    code, _, err = run(capsys, "config", "--recipe", "tiny", "harvest.n=0")
    assert code == 2 and "'harvest.n': n must be >= 1" in err


def test_config_markdown_is_docs_config_md(capsys):
    code, out, _ = run(capsys, "config", "--markdown")
    assert code == 0
    assert out == reference.markdown()
    current = (ROOT / "docs" / "config.md").read_text()
    assert current == out, "docs/config.md is out of date: run `redumix config --markdown > docs/config.md`"
    for section in reference.sections():
        for key in section.keys:
            assert key.help, f"{key.dotted} has no metadata help"
            assert f"| `{key.dotted}` |" in out
    assert run(capsys, "config", "--markdown", "--recipe", "tiny")[0] == 2


def test_decoders_lists_each_decoder_with_its_help(capsys):
    code, out, _ = run(capsys, "decoders")
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == len(DECODERS)
    for line, (name, entry) in zip(lines, DECODERS.items(), strict=True):
        assert line.startswith(name + entry.suffix + " ") and entry.help in line


def test_recipes_resolve_from_any_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert load_config("tiny").name == "tiny"
    assert load_config("tiny.yaml").name == "tiny"
    assert load_config("recipes/tiny.yaml").name == "tiny"  # the Makefile's default, from elsewhere
    assert load_config(None).name == "default"
    own = tmp_path / "mine.yaml"
    own.write_text("harvest:\n  n: 7\n")
    assert load_config(own).harvest.n == 7 and load_config("mine.yaml").name == "mine"
    code, _, err = run(capsys, "harvest", "--recipe", "nope", "--run-dir", str(tmp_path / "run"))
    assert code == 2
    assert "recipe not found: nope (pass --recipe PATH to a YAML file, or a bundled recipe's name: " in err
    assert "tiny" in err and "smollm2-135m-arith" in err
    assert not (tmp_path / "run").exists()


def test_config_command_runs_from_another_directory(tmp_path):
    done = subprocess.run([sys.executable, "-m", "redumix.pipeline.cli", "config", "--recipe", "tiny"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load(done.stdout)["harvest"]["n"] == load_config("tiny").harvest.n
    assert list(tmp_path.iterdir()) == []


def test_make_help_lists_the_targets():
    done = subprocess.run(["make", "-s", "--no-print-directory", "help"], cwd=ROOT, capture_output=True, text=True,
                          check=True)
    phony = re.search(r"^\.PHONY: (.*)$", (ROOT / "Makefile").read_text(), re.M).group(1).split()
    for target in phony:
        if target != "$(STAGES)":
            assert f"make {target} " in done.stdout, target
    assert " ".join(STAGES) in done.stdout


def test_a_refused_harvest_names_the_keys_that_differ_and_changes_nothing(tmp_path):
    marker = tmp_path / "fingerprint.json"
    theirs = {"seed": 0, "redumix": {"lam": 0.5, "topk": 32}, "harvest": {"n": 8}}
    marker.write_text(json.dumps({"version": RECORD_VERSION, "fingerprint": fingerprint(theirs), "record": theirs}))
    ours = {"seed": 0, "redumix": {"lam": 0.7, "topk": 32}, "harvest": {"n": 8, "skip": 8}}
    said = 'what differs: harvest.skip: "(unset)" -> 8, redumix.lam: 0.5 -> 0.7'
    with pytest.raises(ValueError, match=re.escape(said)):
        accept_folder(tmp_path, ours)
    assert accept_folder(tmp_path, theirs) == {fingerprint(theirs)}
    old = json.dumps({"fingerprint": "abc"})  # a folder harvested before the settings were kept
    marker.write_text(old)
    with pytest.raises(ValueError, match="predates the stored settings"):
        accept_folder(tmp_path, ours)
    assert marker.read_text() == old


def test_records_resume_only_under_the_settings_that_made_them(tmp_path):
    path = tmp_path / "settings.json"
    claim_settings(path, {"seed": 0, "task": {"n": 3}}, "ladder records", "use another --run-dir")
    claim_settings(path, {"seed": 0, "task": {"n": 3}}, "ladder records", "use another --run-dir")  # the same: fine
    with pytest.raises(ValueError, match=r"settings.json: the ladder records here were made with other settings "
                                         r"\(task.n: 3 -> 4\); use another --run-dir"):
        claim_settings(path, {"seed": 0, "task": {"n": 4}}, "ladder records", "use another --run-dir")
    assert json.loads(path.read_text())["record"] == {"seed": 0, "task": {"n": 3}}  # the first claim stays


def test_the_shipped_base_is_found_from_another_directory(tmp_path, monkeypatch):
    """`embedded.shipped: models/tiny-base` is relative to the repository when the run starts elsewhere, so
    `redumix harvest --recipe tiny` copies the shipped build there too instead of building for minutes."""
    from redumix.pipeline.embedded_stage import shipped_embedded

    monkeypatch.chdir(tmp_path)
    assert shipped_embedded(load_config("tiny")) == ROOT / "models" / "tiny-base"


def test_a_stage_is_quiet_about_the_libraries_unless_verbose(tmp_path):
    """`redumix train` prints its own lines and the Trainer's steps, not the libraries' loading and dataset bars
    or their warnings; `-v` brings those back."""
    import os
    import shutil

    from tests.train_fixtures import write_base, write_harvest

    run_dir = tmp_path / "run"
    write_base(run_dir / "base")
    write_harvest(run_dir / "harvest", n_rows=16, length=12)

    def train(*extra: str) -> str:
        command = [sys.executable, "-m", "redumix.pipeline.cli", "train", "--run-dir", str(run_dir), *extra,
                   f"model.path={run_dir / 'base'}", "train.max_steps=2", "train.adapter=full", "train.batch_size=4"]
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              # not what an in-process main() of another test left in this process's environment
                              env={**{k: v for k, v in os.environ.items() if k not in QUIET_ENVIRONMENT},
                                   "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout + done.stderr

    quiet = train()
    assert "train: held-out KL" in quiet and "'loss'" in quiet  # our summary and the Trainer's steps
    for noise in ("Loading weights", "Map:", "Filter:", "Warning", "WARNING"):
        assert noise not in quiet, noise
    shutil.rmtree(run_dir / "train")
    assert "Loading weights" in train("-v")  # (the datasets' maps are cached by now, so they make no bar)


def test_grades_keep_each_prompts_verdict_and_a_hash_of_its_reply(tmp_path, capsys):
    generations = tmp_path / "eval" / "generations"
    generations.mkdir(parents=True)
    records = [{"id": "mbpp-11", "model": "abc:greedy", "output": "def f(): return 1", "correct": True, "tokens": 7},
               {"id": "mbpp-12", "model": "abc:greedy", "output": "oops", "correct": False, "tokens": 2}]
    (generations / "base--greedy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["grades", str(tmp_path / "eval"), str(tmp_path / "records")]) == 0
    lines = [json.loads(line) for line in (tmp_path / "records" / "base--greedy.jsonl").read_text().splitlines()]
    assert [(g["id"], g["correct"], g["tokens"]) for g in lines] == [("mbpp-11", True, 7), ("mbpp-12", False, 2)]
    assert lines[0]["sha256"] != lines[1]["sha256"] and "output" not in lines[0]
    index = json.loads((tmp_path / "records" / "index.json").read_text())
    assert index == {"base--greedy.jsonl": {"model": ["abc:greedy"], "n": 2, "accuracy": 0.5}}
    assert main(["grades", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert "no records; run `redumix eval` first" in capsys.readouterr().err
    # A folder of evals (an evidence folder): each eval's grades at its run folder's place in the tree.
    for place in ["base", "mixture/seed-0", "mixture/seed-0/forgetting/gsm8k"]:
        shutil.copytree(tmp_path / "eval", tmp_path / "evidence" / place / "eval")
    (tmp_path / "evidence" / "mixture" / "seed-0" / "train").mkdir()
    assert main(["grades", str(tmp_path / "evidence"), str(tmp_path / "tree")]) == 0
    written = sorted(str(p.relative_to(tmp_path / "tree")) for p in (tmp_path / "tree").rglob("*.jsonl"))
    assert written == ["base/base--greedy.jsonl", "mixture/seed-0/base--greedy.jsonl",
                       "mixture/seed-0/forgetting/gsm8k/base--greedy.jsonl"]
    assert json.loads((tmp_path / "tree" / "mixture" / "seed-0" / "index.json").read_text()) == index
