"""The bad-input matrix: one bad input per test, fed to the real entry points (the CLI, the stages, the loaders).

Each row asserts ONE clear error that names the file (and line) or the config key and says what to do, and, where
outputs existed before, that they are byte-identical afterwards. The length rows are not errors by design: they
assert the documented behaviour instead. docs/robustness.md's "Bad input" table lists the same rows.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest

from bench.models import (
    SPECIALS,
    TINY_CHAT_TEMPLATE,
    TINY_SPLIT,
    build_tiny_model,
    build_tiny_tokenizer,
    build_train_tokenizer,
    char_tokenizer,
    tiny_vocab,
)
from redumix.data.chat import prompt_ids
from redumix.data.gsm8k import Gsm8kConfig
from redumix.data.prompts import attempt_messages
from redumix.data.shards import SCHEMA, iter_rows, read_shard, shard_paths, shard_record
from redumix.data.tasks import TaskConfig, make_task
from redumix.generate.model_io import load_model
from redumix.pipeline.cli import main
from redumix.pipeline.config import load_config
from redumix.pipeline.harvest import run_harvest
from redumix.pipeline.resolve import ConfigError
from redumix.pipeline.run import RunDir
from redumix.pipeline.train import run_train
from redumix.train.data import is_heldout
from tests.train_fixtures import write_base, write_harvest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "tiny.yaml")
SMALL = [
    "harvest.n=4", "harvest.shard_rows=2", "harvest.batch_size=2", "sampling.max_new_tokens=6",
    "sampling.temperature=1.0", "redumix.reflection_max_tokens=6", "redumix.topk=8",
]
TRAIN_FAST = ["train.adapter=full", "train.max_steps=1", "train.batch_size=4", "train.save_steps=1"]
GOOD = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(6)]


# --- helpers --------------------------------------------------------------------------------------------------------


def cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    """Run `redumix ARGV` in-process; (exit code, stderr)."""
    capsys.readouterr()
    code = main(list(argv))
    return code, capsys.readouterr().err


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_error(err: str, stage: str) -> str:
    """The single error line the CLI printed for `stage` (no traceback)."""
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith(f"redumix {stage}: error: ")]
    assert len(lines) == 1, err
    return lines[0]


def config_error(err: str) -> list[str]:
    """The problems of the one config error the CLI printed (`redumix: invalid config:` then one per line)."""
    assert "Traceback" not in err
    header, *problems = err.strip().splitlines()
    assert header == "redumix: invalid config:"
    return [p.strip() for p in problems]


def gsm8k_dir(folder: Path, lines: list[object]) -> Path:
    """DIR/train.jsonl and DIR/test.jsonl holding `lines` (dicts are dumped as JSON, strings written as they are)."""
    folder.mkdir(parents=True)
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    (folder / "train.jsonl").write_text(text)
    (folder / "test.jsonl").write_text(text)
    return folder


def harvest_cli(capsys: pytest.CaptureFixture, run_dir: Path, model_dir: Path, *extra: str) -> tuple[int, str]:
    return cli(capsys, "harvest", "--recipe", RECIPE, "--run-dir", str(run_dir), f"model.path={model_dir}",
               *SMALL, *extra)


def rewrite_shard(run_dir: Path, change: Callable[[pa.Table], pa.Table]) -> Path:
    """Rewrite shard-00001 through `change` and record its new checksum in manifest.json, as a shard that another
    version wrote would be: the manifest then matches it, so only reading the shard can tell it is wrong."""
    folder = run_dir / "harvest"
    path = folder / "shard-00001.arrow"
    table = change(read_shard(path))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    path.write_bytes(sink.getvalue().to_pybytes())
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["shard_files"][path.name] = shard_record(path)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return path


def fixture_run(tmp_path: Path, n_rows: int = 8, length: int = 6) -> Path:
    """A run folder with a tiny base model and harvest shards (tests/train_fixtures.py), two shards of four rows."""
    run_dir = tmp_path / "run"
    write_base(run_dir / "base")
    write_harvest(run_dir / "harvest", n_rows=n_rows, length=length, shard_rows=4)
    return run_dir


@pytest.fixture(scope="module")
def harvested(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A real, complete harvest (two shards, manifest, fingerprint) made once; tests copy it."""
    run_dir = tmp_path_factory.mktemp("harvested")
    run_harvest(load_config(RECIPE, [f"model.path={tiny_model_dir}", *SMALL]), RunDir(run_dir))
    return run_dir


@pytest.fixture
def harvest_copy(harvested: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(harvested, run_dir)
    return run_dir


# --- recipes --------------------------------------------------------------------------------------------------------


def test_recipe_unknown_key(tmp_path, capsys):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("sampling:\n  temprature: 0.7\n")
    code, err = cli(capsys, "harvest", "--recipe", str(recipe), "--run-dir", str(tmp_path / "run"))
    assert code == 2
    assert config_error(err) == [f"{recipe}: unknown key 'sampling.temprature' (did you mean 'sampling.temperature'?)"]
    assert not (tmp_path / "run").exists()  # nothing is written before the config resolves


def test_recipe_wrong_type(tmp_path, capsys):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("harvest:\n  n: many\n")
    code, err = cli(capsys, "harvest", "--recipe", str(recipe), "--run-dir", str(tmp_path / "run"))
    assert code == 2 and config_error(err) == [f"{recipe}: 'harvest.n' = 'many' is not int"]
    assert not (tmp_path / "run").exists()


def test_recipe_out_of_range_value_names_the_key_where_it_was_set(tmp_path, capsys):
    code, err = cli(capsys, "harvest", "--recipe", RECIPE, "--run-dir", str(tmp_path / "run"), "redumix.lam=1.5",
                    "harvest.batch_size=0")
    assert code == 2
    assert sorted(config_error(err)) == [  # one error listing both; not the recipe, which also sets harvest.*
        "command line: 'harvest.batch_size': batch_size must be >= 1",
        "command line: 'redumix.lam': lam must be in [0, 1], got 1.5",
    ]
    assert not (tmp_path / "run").exists()


def test_recipe_file_missing(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    code, err = cli(capsys, "harvest", "--recipe", str(missing), "--run-dir", str(tmp_path / "run"))
    assert code == 2
    assert f"recipe not found: {missing} (pass --recipe PATH to a YAML file" in err


def test_recipe_not_yaml(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("harvest:\n  n: [1, 2\n")
    with pytest.raises(ConfigError, match=rf"{recipe}:3: not valid YAML \(expected ',' or '\]', .*, while "
                                          r"parsing a flow sequence from line 2\); fix the YAML there"):
        load_config(recipe)


@pytest.mark.parametrize("text", ["", "\n\n", "# tiny, but the settings were never saved\n# name: mine\n", "{}\n"],
                         ids=["empty", "blank-lines", "only-comments", "empty-mapping"])
def test_recipe_that_sets_nothing(tmp_path, capsys, text):
    recipe = tmp_path / "blank.yaml"
    recipe.write_text(text)
    # model.path pointing nowhere: were the recipe taken, the harvest would stop at once instead of building a model
    code, err = cli(capsys, "harvest", "--recipe", str(recipe), "--run-dir", str(tmp_path / "run"),
                    f"model.path={tmp_path / 'nowhere'}")
    assert code == 2
    assert err.splitlines() == [f"redumix: {recipe}: the recipe sets nothing (it is empty or holds only comments); "
                                "write its settings there, or pass the recipe you meant to --recipe"]
    assert not (tmp_path / "run").exists()


def test_no_recipe_given_runs_on_the_defaults(capsys):
    """Leaving --recipe out is a choice, not a blank file: the CLI takes the bundled default recipe, and the library
    the dataclass defaults."""
    assert main(["config"]) == 0 and capsys.readouterr().out.startswith("name: tiny\n")
    assert load_config(None).name == "default"


def test_recipe_not_utf8(tmp_path, capsys):
    recipe = tmp_path / "latin1.yaml"
    recipe.write_bytes("harvest:\n  n: 4  # caf\xe9\n".encode("latin-1"))
    code, err = cli(capsys, "harvest", "--recipe", str(recipe), "--run-dir", str(tmp_path / "run"))
    assert code == 2
    assert err.splitlines() == [f"redumix: {recipe}:2: not UTF-8 text (byte 0xe9 at column 14: invalid continuation "
                                "byte); save the recipe as UTF-8"]
    assert not (tmp_path / "run").exists()


def test_override_without_a_value():
    with pytest.raises(ConfigError, match=r"command line: override 'harvest\.n' is not of the form key\.sub=value"):
        load_config(RECIPE, ["harvest.n"])


def test_model_folder_missing(tmp_path, capsys):
    nowhere = tmp_path / "nowhere"
    code, err = harvest_cli(capsys, tmp_path / "run", nowhere)
    assert code == 2  # refused at the door, as a config error, naming where model.path was set
    assert err.strip() == (f"redumix: command line: 'model.path' = '{nowhere}': no such folder; set model.path to a "
                           "local Hugging Face model folder (one with config.json), or to 'embedded' for the embedded "
                           "default model")
    assert not (tmp_path / "run").exists()  # nothing written: a rerun with the right path is not refused


def test_model_folder_without_chat_template(tmp_path, capsys, tiny_model_dir):
    model_dir = tmp_path / "no-template"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    settings = json.loads((model_dir / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(settings))
    code, err = harvest_cli(capsys, tmp_path / "run", model_dir)
    assert code == 1
    line = one_error(err, "harvest")
    assert f"{model_dir}: the tokenizer has no chat template" in line and "add one (chat_template.jinja" in line
    assert not (tmp_path / "run" / "harvest").exists()


@pytest.mark.parametrize(
    ("arch", "message"),
    [
        # A Llama folder: the tokenizer loads with neither token.
        ("llama", r"the tokenizer has neither a pad token nor an eos token, so batches cannot be padded"),
        # A Qwen2 folder: transformers fills in Qwen2's default '<|endoftext|>', an id the model does not have.
        ("qwen2", r"the tokenizer's pad/eos token '<\|endoftext\|>' \(id 104\) is outside the model's 104-token "
                  r"vocabulary"),
    ],
    ids=["llama-neither", "qwen2-default-outside-vocab"],
)
def test_tokenizer_without_pad_or_eos(tmp_path, arch, message):
    # The tests' tiny tokenizer with no pad and no eos token.
    tokenizer = char_tokenizer(tiny_vocab(SPECIALS), TINY_SPLIT, TINY_CHAT_TEMPLATE, unk_token="<|unk|>")
    model_dir = tmp_path / "no-eos"
    build_tiny_model(tokenizer, arch=arch).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    with pytest.raises(ValueError, match=rf"{model_dir}: {message}.*set 'eos_token' \(and 'pad_token'\) in "
                                         rf"{model_dir / 'tokenizer_config.json'}"):
        load_model(model_dir)


# --- task data -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"question": "broken"', r"train\.jsonl:3: not valid JSON \(.*\); fix or remove that line"),
        ({"answer": "#### 3"}, r"train\.jsonl:3: expected an object with 'question' and 'answer' strings; fix or"),
        ({"question": "What is 2 + 1?"}, r"train\.jsonl:3: expected an object with 'question' and 'answer'"),
        ({"question": "  ", "answer": "#### 3"}, r"train\.jsonl:3: 'question' is empty.*; fix or remove that line"),
        ({"question": "How many?", "answer": "#### twelve"},
         r"train\.jsonl:3: 'answer' must end in '#### N' with N a number, but its gold answer is 'twelve'; fix or"),
    ],
    ids=["malformed-json", "no-question", "no-answer", "empty-question", "gold-not-a-number"],
)
def test_gsm8k_bad_line(tmp_path, capsys, tiny_model_dir, bad_line, message):
    data = gsm8k_dir(tmp_path / "gsm8k", [*GOOD[:2], bad_line, *GOOD[2:]])
    code, err = harvest_cli(capsys, tmp_path / "run", tiny_model_dir, "task.name=gsm8k", f"task.gsm8k.path={data}")
    assert code == 1
    line = one_error(err, "harvest")
    assert str(data / "train.jsonl") in line
    assert re.search(message, line), line
    assert not (tmp_path / "run" / "harvest").exists()  # the data is read before the folder is claimed


@pytest.mark.parametrize("line_no", [1, 3])
def test_gsm8k_byte_that_is_not_utf8(tmp_path, capsys, tiny_model_dir, line_no):
    data = gsm8k_dir(tmp_path / "gsm8k", GOOD)
    for split in ("train", "test"):
        lines = (data / f"{split}.jsonl").read_bytes().split(b"\n")
        latin1 = json.dumps({"question": "Café: 2 + 2?", "answer": "#### 4"}, ensure_ascii=False).encode("latin-1")
        lines[line_no - 1] = latin1
        (data / f"{split}.jsonl").write_bytes(b"\n".join(lines))
    code, err = harvest_cli(capsys, tmp_path / "run", tiny_model_dir, "task.name=gsm8k", f"task.gsm8k.path={data}")
    assert code == 1
    assert one_error(err, "harvest") == (
        f"redumix harvest: error: {data / 'train.jsonl'}:{line_no}: not UTF-8 text (byte 0xe9 at column 18: invalid "
        "continuation byte); save the file as UTF-8, or fix or remove that line")
    assert not (tmp_path / "run" / "harvest").exists()


def test_gsm8k_empty_prompt_through_the_task(tmp_path):
    data = gsm8k_dir(tmp_path / "gsm8k", [GOOD[0], {"question": "", "answer": "#### 1"}])
    task = make_task(TaskConfig(name="gsm8k", gsm8k=Gsm8kConfig(path=str(data))), seed=0)
    with pytest.raises(ValueError, match=rf"{data / 'test.jsonl'}:2: 'question' is empty"):
        task.examples("test", None)


def test_gsm8k_folder_missing(tmp_path, capsys, tiny_model_dir):
    missing = tmp_path / "no-gsm8k"
    code, err = harvest_cli(capsys, tmp_path / "run", tiny_model_dir, "task.name=gsm8k", f"task.gsm8k.path={missing}")
    assert code == 1
    assert f"GSM8K file not found: {missing / 'train.jsonl'} (set task.gsm8k.path" in one_error(err, "harvest")
    assert not (tmp_path / "run" / "harvest").exists()


def test_empty_split_harvests_nothing_and_says_so(tmp_path, capsys, tiny_model_dir):
    data = gsm8k_dir(tmp_path / "gsm8k", [])
    code, err = harvest_cli(capsys, tmp_path / "run", tiny_model_dir, "task.name=gsm8k", f"task.gsm8k.path={data}")
    assert code == 1
    line = one_error(err, "harvest")
    assert f"{data / 'train.jsonl'}: no examples" in line and "set task.gsm8k.path" in line
    assert not (tmp_path / "run" / "harvest").exists()  # no empty "complete" harvest for train to trip on


def test_human_feedback_missing_the_harvested_ids(tmp_path, capsys, tiny_model_dir):
    data = gsm8k_dir(tmp_path / "gsm8k", GOOD)
    feedback = tmp_path / "feedback.jsonl"
    feedback.write_text(json.dumps({"id": "gsm8k-train-00000", "feedback": "Check step 2."}) + "\n"
                        + json.dumps({"id": "someone-else-1", "feedback": "?"}) + "\n")
    code, err = harvest_cli(capsys, tmp_path / "run", tiny_model_dir, "task.name=gsm8k", f"task.gsm8k.path={data}",
                            "redumix.feedback=human", f"redumix.feedback_file={feedback}")
    assert code == 1
    line = one_error(err, "harvest")
    assert f"{feedback}: no feedback for 3 of the 4 examples to harvest, e.g. ids ['gsm8k-train-00001'" in line
    assert 'add one line {"id": ..., "feedback": ...} for each' in line
    assert not (tmp_path / "run" / "harvest").exists()  # checked up front: no shard harvested before the error


def test_human_feedback_duplicate_ids(tmp_path, capsys, tiny_model_dir):
    data = gsm8k_dir(tmp_path / "gsm8k", GOOD)
    feedback = tmp_path / "feedback.jsonl"
    ids = [0, 1, 2, 1, 3]
    feedback.write_text("".join(json.dumps({"id": f"gsm8k-train-{i:05d}", "feedback": "Hm."}) + "\n" for i in ids))
    code, err = harvest_cli(capsys, tmp_path / "run", tiny_model_dir, "task.name=gsm8k", f"task.gsm8k.path={data}",
                            "redumix.feedback=human", f"redumix.feedback_file={feedback}")
    assert code == 1
    line = one_error(err, "harvest")
    assert f"{feedback}:4: id 'gsm8k-train-00001' appears twice (first on line 2); keep one line per id" in line
    assert not (tmp_path / "run" / "harvest").exists()


def test_human_feedback_file_missing(tmp_path, capsys, tiny_model_dir):
    missing = tmp_path / "nofile.jsonl"
    code, err = harvest_cli(capsys, tmp_path / "run", tiny_model_dir, "redumix.feedback=human",
                            f"redumix.feedback_file={missing}")
    assert code == 1
    assert f"feedback file not found: {missing} (set redumix.feedback_file" in one_error(err, "harvest")
    assert not (tmp_path / "run" / "harvest").exists()


# --- shards ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncated", "flipped-bytes"])
def test_damaged_shard_is_named_and_nothing_is_touched(harvest_copy, capsys, tiny_model_dir, damage):
    shard = harvest_copy / "harvest" / "shard-00001.arrow"
    data = shard.read_bytes()
    if damage == "truncated":
        shard.write_bytes(data[: len(data) // 2])
    else:
        middle = len(data) // 2
        shard.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[middle : middle + 8]) + data[middle + 8 :])
        assert shard.stat().st_size == len(data)
    before = snapshot(harvest_copy / "harvest")
    for stage in ("train", "export"):
        code, err = cli(capsys, stage, "--recipe", RECIPE, "--run-dir", str(harvest_copy),
                        f"model.path={tiny_model_dir}", *SMALL)
        assert code == 1
        line = one_error(err, stage)
        assert "shard-00001.arrow no longer match manifest.json" in line
        assert "run `redumix harvest` again, which redoes those shards only" in line
    assert snapshot(harvest_copy / "harvest") == before  # the other shard and the manifest byte-identical
    assert not (harvest_copy / "train").exists() and not (harvest_copy / "export").exists()


def _drop_redo_ids(table: pa.Table) -> pa.Table:
    return table.drop_columns(["redo_token_ids"])


def _redo_ids_as_text(table: pa.Table) -> pa.Table:
    ids = [[str(t) for t in row] for row in table["redo_token_ids"].to_pylist()]
    return table.set_column(table.column_names.index("redo_token_ids"), "redo_token_ids",
                            pa.array(ids, pa.list_(pa.string())))


def _topk_longer_than_redo(table: pa.Table) -> pa.Table:
    topk = table["mix_topk_ids"].to_pylist()
    topk[0] = [*topk[0], topk[0][-1]]  # one more step of top-k than the redo has tokens
    field = SCHEMA.field("mix_topk_ids")
    return table.set_column(table.column_names.index("mix_topk_ids"), field, pa.array(topk, field.type))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_drop_redo_ids, "missing columns ['redo_token_ids']; it was not written by this version of redumix: "),
        (_redo_ids_as_text, "column 'redo_token_ids' holds list<item: string>, not list<item: int32>; it was not "
                            "written by this version of redumix: "),
        (_topk_longer_than_redo, "row 't-00004': mix_topk_ids has 7 entries but redo_token_ids has 6; the shard is "
                                 "corrupt: "),
    ],
    ids=["missing-column", "wrong-dtype", "topk-longer-than-redo"],
)
def test_shard_with_bad_contents_is_named_and_nothing_is_touched(tmp_path, capsys, change, message):
    run_dir = fixture_run(tmp_path)
    shard = rewrite_shard(run_dir, change)
    before = snapshot(run_dir / "harvest")
    for stage in ("train", "export"):
        code, err = cli(capsys, stage, "--recipe", RECIPE, "--run-dir", str(run_dir), f"model.path={run_dir / 'base'}",
                        *TRAIN_FAST)
        assert code == 1
        line = one_error(err, stage)
        assert f"{shard}: {message}delete it and run `redumix harvest` again, which redoes only" in line
    assert snapshot(run_dir / "harvest") == before
    assert not (run_dir / "train").exists() and not (run_dir / "export").exists()


def test_shards_of_another_config_are_refused(harvest_copy, capsys, tiny_model_dir):
    before = snapshot(harvest_copy / "harvest")
    code, err = harvest_cli(capsys, harvest_copy, tiny_model_dir, "redumix.lam=0.7")
    assert code == 1
    line = one_error(err, "harvest")
    assert f"{harvest_copy / 'harvest'} holds a harvest made with a different config" in line
    assert "use another --run-dir, or delete that folder to harvest again" in line
    assert snapshot(harvest_copy / "harvest") == before


def test_empty_harvest_is_named(tmp_path, capsys):
    run_dir = tmp_path / "run"
    write_base(run_dir / "base")
    write_harvest(run_dir / "harvest", n_rows=0)  # a manifest that lists no shards
    before = snapshot(run_dir / "harvest")
    code, err = cli(capsys, "train", "--recipe", RECIPE, "--run-dir", str(run_dir), f"model.path={run_dir / 'base'}")
    assert code == 1
    line = one_error(err, "train")
    assert f"{run_dir / 'harvest'}: the harvest is empty" in line and "run `redumix harvest` again" in line
    assert snapshot(run_dir / "harvest") == before


def test_manifest_not_json(harvest_copy, capsys, tiny_model_dir):
    manifest = harvest_copy / "harvest" / "manifest.json"
    manifest.write_text('{"rows": 4, "shards": [')
    before = snapshot(harvest_copy / "harvest")
    code, err = cli(capsys, "train", "--recipe", RECIPE, "--run-dir", str(harvest_copy),
                    f"model.path={tiny_model_dir}")
    assert code == 1
    line = one_error(err, "train")
    assert f"{manifest}: not valid JSON" in line and "delete it to redo the stage that wrote it" in line
    assert snapshot(harvest_copy / "harvest") == before


# --- lengths: not errors, the documented behaviour ------------------------------------------------------------------


def test_x2_longer_than_the_window_compresses_the_attempt(tmp_path, tiny_model_dir):
    settings = ["harvest.n=1", "harvest.shard_rows=1", "harvest.batch_size=1", "sampling.max_new_tokens=30",
                "sampling.temperature=1.0", "redumix.reflection_max_tokens=6", "redumix.topk=8"]
    run_harvest(load_config(RECIPE, [f"model.path={tiny_model_dir}", *settings]), RunDir(tmp_path / "roomy"))
    [roomy] = iter_rows(shard_paths(tmp_path / "roomy" / "harvest"))
    tokens = json.loads(roomy["meta"])["tokens"]
    assert json.loads(roomy["meta"])["y1_compressed_tokens"] == 0 and tokens["original"] == 30
    # x2 at the reflection's and redo's caps, less 3: the attempt must lose 3 tokens plus the note's.
    window = tokens["x2"] - tokens["reflection"] + 6 + 30 - 3
    tight = tmp_path / "tight"
    tokenizer = build_tiny_tokenizer()
    build_tiny_model(tokenizer, max_positions=window).save_pretrained(tight)  # same seed: same weights
    tokenizer.save_pretrained(tight)
    run_harvest(load_config(RECIPE, [f"model.path={tight}", *settings]), RunDir(tmp_path / "run"))
    [row] = iter_rows(shard_paths(tmp_path / "run" / "harvest"))
    meta = json.loads(row["meta"])
    assert 3 < meta["y1_compressed_tokens"] < 30  # recorded in the row's meta
    assert meta["tokens"]["x2"] + len(row["redo_token_ids"]) <= window
    assert len(row["mix_topk_ids"]) == len(row["redo_token_ids"]) > 0


def test_redo_longer_than_max_length_is_cut_to_fit(tmp_path):
    run_dir = fixture_run(tmp_path, n_rows=8, length=24)
    prompt = len(prompt_ids(build_train_tokenizer(), attempt_messages("What is 1 + 1?")))  # every fixture prompt: 17
    held = sum(is_heldout(f"t-{i:05d}", 0.5) for i in range(8))
    before = snapshot(run_dir / "harvest")
    config = load_config(RECIPE, [f"model.path={run_dir / 'base'}", *TRAIN_FAST, "train.heldout_fraction=0.5",
                                  f"train.max_length={prompt + 5}"])
    result = run_train(config, RunDir(run_dir))
    counts = {k: result["rows"][k] for k in ("harvested", "selected", "train", "heldout")}
    assert counts == {"harvested": 8, "selected": 8, "train": 8 - held, "heldout": held}
    assert result["heldout_tokens"] == 5 * held  # each 24-token redo cut to the 5 tokens that fit
    assert snapshot(run_dir / "harvest") == before


def test_prompt_that_fills_max_length_leaves_nothing_to_learn(tmp_path, capsys):
    run_dir = fixture_run(tmp_path)
    before = snapshot(run_dir / "harvest")
    code, err = cli(capsys, "train", "--recipe", RECIPE, "--run-dir", str(run_dir), f"model.path={run_dir / 'base'}",
                    *TRAIN_FAST, "train.max_length=10")
    assert code == 1
    line = one_error(err, "train")
    assert "every selected prompt fills train.max_length=10 tokens by itself" in line
    assert "raise train.max_length" in line
    assert snapshot(run_dir / "harvest") == before and not (run_dir / "train").exists()


# --- run folder ------------------------------------------------------------------------------------------------------


EVAL_SMALL = ["eval.n=2", "eval.n_other=2", "eval.decoders=[greedy]", "sampling.max_new_tokens=4"]


def test_eval_on_an_empty_run_folder_just_runs(tmp_path, capsys, tiny_model_dir):
    run_dir = tmp_path / "run"
    capsys.readouterr()
    assert main(["eval", "--recipe", RECIPE, "--run-dir", str(run_dir), f"model.path={tiny_model_dir}",
                 *EVAL_SMALL]) == 0
    out = capsys.readouterr().out
    assert f"no tuned checkpoint at {run_dir / 'train' / 'merged'} (run `redumix train` first)" in out
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert [(r["checkpoint"], r["decoder"], r["n"]) for r in report["rows"]] == [("base", "greedy", 2)]


def test_eval_unknown_decoder_leaves_the_report(tmp_path, capsys, tiny_model_dir):
    run_dir = tmp_path / "run"
    common = ["eval", "--recipe", RECIPE, "--run-dir", str(run_dir), f"model.path={tiny_model_dir}", *EVAL_SMALL]
    assert main(common) == 0
    before = snapshot(run_dir / "eval")
    code, err = cli(capsys, *common, "eval.decoders=[greedy, gredy]")
    assert code == 1
    assert "eval.decoders: unknown decoder 'gredy' (known: greedy," in one_error(err, "eval")
    assert snapshot(run_dir / "eval") == before  # report.json, report.md, the plot and the records byte-identical


@pytest.mark.parametrize("stage", ["train", "export"])
def test_stage_before_harvest(tmp_path, capsys, tiny_model_dir, stage):
    run_dir = tmp_path / "run"
    code, err = cli(capsys, stage, "--recipe", RECIPE, "--run-dir", str(run_dir), f"model.path={tiny_model_dir}")
    assert code == 1
    line = one_error(err, stage)
    assert f"{run_dir / 'harvest'}: no complete harvest (no manifest.json); run `redumix harvest` first" in line
    assert not (run_dir / stage).exists() and not (run_dir / "export").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="running as root: chmod does not stop root's writes, so a read-only "
                                              "run folder cannot be simulated")
def test_read_only_run_folder(harvest_copy, capsys, tiny_model_dir):
    before = snapshot(harvest_copy)
    harvest_copy.chmod(0o555)
    try:
        code, err = harvest_cli(capsys, harvest_copy, tiny_model_dir)
    finally:
        harvest_copy.chmod(0o755)
    assert code == 1
    line = one_error(err, "harvest")
    assert f"{harvest_copy}: Permission denied; give this user access to it" in line
    assert "or pass another --run-dir" in line
    assert snapshot(harvest_copy) == before
