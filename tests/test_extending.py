"""A decoder, a task and a stage are each one line in one table: here each is added in one line (monkeypatching the
table) and run through the command line, with no other edit; and every list the tables feed is derived from them."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from redumix.common.files import atomic_write_json
from redumix.data.arith import arith_problems
from redumix.data.shards import iter_rows, shard_paths
from redumix.data.tasks import TASKS, TaskConfig, TaskEntry, make_task
from redumix.generate.accounting import Usage
from redumix.generate.decoder import Decoded
from redumix.pipeline.cli import STAGES, Stage, main
from redumix.pipeline.config import Config, EvalConfig, load_config
from redumix.pipeline.decoders import DECODERS, DEFAULT_DECODERS, DecoderEntry, decoder_sections, known_decoders
from redumix.pipeline.resolve import ConfigError
from redumix.pipeline.run import RunDir
from tests.test_seams import EchoTask, FirstNumber

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "tiny.yaml")
SMALL = [
    "sampling.max_new_tokens=6", "redumix.reflection_max_tokens=5", "redumix.critique_max_tokens=4",
    "redumix.topk=4", "harvest.n=4", "harvest.shard_rows=2", "harvest.batch_size=2", "eval.batch_size=2",
    "eval.checkpoints=[base]", "eval.tuned_decoders=[]",
]


def cli_run(stage: str, run: Path, model: Path, *overrides: str) -> int:
    return main([stage, "--recipe", RECIPE, "--run-dir", str(run), f"model.path={model}", *SMALL, *overrides])


# --- a decoder -------------------------------------------------------------------------------------------------------


def test_a_decoder_in_one_line_reaches_the_eval_report(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setitem(DECODERS, "first-number", DecoderEntry(None, lambda c, name, _: FirstNumber(name), "", "toy"))

    assert cli_run("eval", tmp_path, tiny_model_dir, "eval.n=3", "eval.n_other=5",
                   "eval.decoders=[greedy, first-number]") == 0
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert [(r["decoder"], r["n"]) for r in report["rows"]] == [("greedy", 3), ("first-number", 5)]
    records = [json.loads(x) for x in (tmp_path / "eval" / "generations" / "base--first-number.jsonl").open()]
    first_numbers = [re.search(r"\d+", r["prompt"]).group() for r in records]
    assert [r["output"] for r in records] == [f"The answer is {n}." for n in first_numbers]


@dataclasses.dataclass
class NthNumberConfig:
    """A test-only decoder's own settings section, `nth`."""

    index: int = dataclasses.field(default=0, metadata={"help": "Which number of the prompt to answer with."})


@dataclasses.dataclass
class NthNumber:
    """Reads no model output: it answers with the prompt's number at `settings.index`."""

    name: str
    settings: NthNumberConfig

    needs_hf_engine = False

    def __call__(self, engine, examples, task):
        out = []
        for example in examples:
            text = f"The answer is {re.findall(r'[0-9]+', example.prompt)[self.settings.index]}."
            ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
            out.append(Decoded(text, ids, Usage(visible_tokens=len(ids))))
        return out


@dataclasses.dataclass
class ConfigWithNth(Config):
    """`Config` with the test decoder's section: what a decoder with settings adds to pipeline/config.py."""

    nth: NthNumberConfig = dataclasses.field(default_factory=NthNumberConfig)


def test_a_decoder_with_its_own_settings_section_runs_through_the_cli(tmp_path, tiny_model_dir, monkeypatch):
    """A decoder with settings costs its module (here, the classes above), one table line and one `Config` field."""
    from redumix.pipeline import config as config_module

    monkeypatch.setattr(config_module, "Config", ConfigWithNth)
    monkeypatch.setitem(DECODERS, "nth-number", DecoderEntry(
        ("nth", NthNumberConfig), lambda c, name, _: NthNumber(name, c.nth), "", "the prompt's n-th number"))

    assert cli_run("eval", tmp_path, tiny_model_dir, "eval.n=3", "eval.n_other=4", "nth.index=1",
                   "eval.decoders=[greedy, nth-number]") == 0
    records = [json.loads(x) for x in (tmp_path / "eval" / "generations" / "base--nth-number.jsonl").open()]
    assert len(records) == 4
    assert [r["output"] for r in records] == [f"The answer is {re.findall(r'[0-9]+', r['prompt'])[1]}."
                                              for r in records]
    assert "nth:\n  index: 1\n" in (tmp_path / "config.yaml").read_text()  # the section is saved with the run
    assert cli_run("eval", tmp_path / "typo", tiny_model_dir, "nth.indx=1") == 2  # an unknown key in it is an error


def test_unknown_decoders_get_the_derived_known_message(tmp_path, tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setitem(DECODERS, "first-number", DecoderEntry(None, lambda c, name, _: FirstNumber(name), "", "toy"))

    assert cli_run("eval", tmp_path, tiny_model_dir, "eval.decoders=[greedy, gredy, first-number@2]") == 1
    err = capsys.readouterr().err
    assert f"unknown decoder 'gredy' (known: {known_decoders()})" in err
    assert "first-number[" not in known_decoders() and known_decoders().endswith(", first-number")
    assert "redumix-oracle[@λ], redumix-self[@λ]" in err and "vote[@N]" in err
    assert "decoder 'first-number@2': only these take an @ suffix: redumix-oracle@λ, redumix-self@λ, vote@N" in err
    assert not (tmp_path / "eval").exists()  # refused before any model loads


def test_the_lists_of_decoders_come_from_the_table():
    sections = decoder_sections()
    assert list(sections) == ["redumix", "moi", "cntp", "pdr", "reflective", "speculative"]
    # Every section a table line names is a field of the written Config (config.redumix is a RedumixConfig, ...).
    fields = typing.get_type_hints(Config)
    assert all(fields[key] is cls for key, cls in sections.items())
    # Every decoder runs by default but those that need a second model (speculative.guide_path).
    assert {name.partition("@")[0] for name in DEFAULT_DECODERS} == {n for n, e in DECODERS.items() if e.default}
    assert [n for n, e in DECODERS.items() if not e.default] == [
        "guide-greedy", "speculative-thinking", "speculative-random"]
    assert DEFAULT_DECODERS == [
        "greedy", "sample", "longhand", "redumix-oracle@1", "redumix-oracle", "redumix-oracle@0", "redumix-self",
        "moi", "cntp", "vote", "pdr", "sr", "reflective", "reflective-periodic", "reflective-random",
        "reflective-fixed",
    ]  # eval's default run, as it was before the table
    [decoders] = [f for f in dataclasses.fields(EvalConfig) if f.name == "decoders"]
    assert all(f"{name}" in decoders.metadata["help"] and entry.help in decoders.metadata["help"]
               for name, entry in DECODERS.items())


# --- a task ----------------------------------------------------------------------------------------------------------


def test_a_task_in_one_line_is_harvested_and_evaluated(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setitem(TASKS, "echo", TaskEntry(None, lambda settings, seed, suffix: EchoTask(), "repeat a number"))

    assert cli_run("harvest", tmp_path, tiny_model_dir, "task.name=echo") == 0
    task = EchoTask()
    rows = list(iter_rows(shard_paths(tmp_path / "harvest")))
    assert [(r["id"], r["task"], r["prompt"]) for r in rows] == [(e.id, e.task, e.prompt)
                                                                 for e in task.examples("train", 4)]
    examples = {e.id: e for e in task.examples("train", 4)}
    assert all(r["feedback"] == task.feedback(r["original"], examples[r["id"]]) for r in rows)  # echo's verifier

    assert cli_run("eval", tmp_path, tiny_model_dir, "task.name=echo", "eval.n=3", "eval.n_other=2",
                   "eval.decoders=[greedy]") == 0
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["task"] == "echo" and [(r["decoder"], r["n"]) for r in report["rows"]] == [("greedy", 3)]
    records = [json.loads(x) for x in (tmp_path / "eval" / "generations" / "base--greedy.jsonl").open()]
    tests = {e.id: e for e in task.examples("test", 3)}
    assert [r["id"] for r in records] == list(tests)
    assert all(r["correct"] == task.is_correct(r["output"], tests[r["id"]]) for r in records)


def test_an_unknown_task_gets_the_derived_known_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(TASKS, "echo", TaskEntry(None, lambda settings, seed, suffix: EchoTask(), "repeat a number"))

    assert main(["harvest", "--recipe", RECIPE, "--run-dir", str(tmp_path), "task.name=nope"]) == 2
    err = capsys.readouterr().err
    assert "command line: 'task.name': unknown task name 'nope' (known: arith, gsm8k, constraints, code, echo)" in err
    assert not list(tmp_path.iterdir())  # nothing written


def test_every_task_s_settings_are_a_field_of_the_task_config():
    fields = typing.get_type_hints(TaskConfig)
    assert all(fields[name] is entry.settings for name, entry in TASKS.items() if entry.settings is not None)


def test_a_task_s_settings_are_its_own_section():
    with pytest.raises(ConfigError, match=r"unknown key 'task.steps_max' \(did you mean 'task.arith.steps_max'\?\)"):
        load_config(RECIPE, ["task.steps_max=2"])  # the layout before task sections
    config = load_config(RECIPE, ["task.arith.steps_max=2", "task.gsm8k.path=elsewhere"])
    assert (config.task.arith.steps_min, config.task.arith.steps_max, config.task.gsm8k.path) == (2, 2, "elsewhere")
    task = make_task(config.task, config.seed)
    assert task.config is config.task.arith
    assert all(len(p.steps) == 2 for p in arith_problems(task.config, "test", 20, config.seed))


# --- a stage ---------------------------------------------------------------------------------------------------------


def run_count(config: Config, run: RunDir) -> None:
    """A test-only stage: count the task's test examples into RUN_DIR/count/count.json."""
    examples = make_task(config.task, config.seed).examples("test", config.eval.n)
    atomic_write_json(run.root / "count" / "count.json", {"task": config.task.name, "examples": len(examples)})


def test_a_stage_in_one_line_runs_from_the_command_line(tmp_path, monkeypatch):
    monkeypatch.setitem(STAGES, "count", Stage(__name__, "run_count", "count the task's test examples"))

    assert main(["count", "--recipe", RECIPE, "--run-dir", str(tmp_path), "eval.n=7"]) == 0
    assert json.loads((tmp_path / "count" / "count.json").read_text()) == {"task": "arith", "examples": 7}
    assert (tmp_path / "config.yaml").is_file()  # the CLI saved the resolved config, as for every stage


def test_the_makefile_runs_the_stages_of_the_cli_table():
    def make_variable(name: str) -> list[str]:
        done = subprocess.run(["make", "-s", "--no-print-directory", f"print-{name}"], cwd=ROOT, capture_output=True,
                              text=True, check=True)
        return done.stdout.split()

    assert make_variable("STAGES") == list(STAGES)
    assert make_variable("RANKED") == [name for name, stage in STAGES.items() if stage.ranked]


def test_a_stage_imports_its_module_only_when_it_runs():
    """`redumix embedded` must not pay for TRL, peft and DeepSpeed: the CLI and the config import none of them."""
    code = ("import sys; from redumix.pipeline.cli import STAGES, resolve; import importlib; "
            f"resolve(['embedded', '--recipe', {RECIPE!r}]); importlib.import_module(STAGES['embedded'].module); "
            "print(sorted(m for m in ('trl', 'peft', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
