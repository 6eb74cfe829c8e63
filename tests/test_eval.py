import json
from pathlib import Path

import pytest

from redumix.data.tasks import make_task
from redumix.generate.accounting import ForwardCounter
from redumix.generate.hf_engine import HfEngine
from redumix.generate.model_io import load_model
from redumix.pipeline.config import load_config
from redumix.pipeline.decoders import DEFAULT_DECODERS, check_decoder_names, make_decoder
from redumix.pipeline.eval import run_eval
from redumix.pipeline.run import RunDir
from redumix.pipeline.stats import wilson_interval

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k"
SMALL = [
    "sampling.max_new_tokens=6", "redumix.reflection_max_tokens=5", "redumix.critique_max_tokens=4",
    "pdr.drafts=2", "pdr.rounds=1", "pdr.workspace_tokens=24", "eval.batch_size=2",
]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir


def test_wilson_interval_matches_known_values():
    low, high = wilson_interval(50, 100)
    assert low == pytest.approx(0.4038, abs=1e-4) and high == pytest.approx(0.5962, abs=1e-4)
    assert wilson_interval(0, 10)[0] == pytest.approx(0.0, abs=1e-12)
    assert wilson_interval(10, 10)[1] == pytest.approx(1.0, abs=1e-12)
    assert wilson_interval(0, 10)[1] == pytest.approx(0.2775, abs=1e-4)


@pytest.mark.parametrize("decoder", DEFAULT_DECODERS)
def test_reported_fpe_equals_forward_counter_for_every_decoder(decoder, model_dir):
    # The recipe's trigger point " = " never comes from a random model: without it the reflective rows reflect.
    overrides = [f"model.path={model_dir}", *SMALL, "reflective.trigger_after=[]"]
    config = load_config(ROOT / "recipes" / "tiny.yaml", overrides)
    model, tokenizer = load_model(model_dir)
    task = make_task(config.task, config.seed)
    examples = task.examples("test", 3)
    earlier = {}
    if decoder.startswith("reflective-"):
        earlier["reflective"] = [
            {"extra": {"visible_tokens": 6, "n_reflections": 1, "hidden_tokens": 3, "trigger_points": 2}}
            for _ in examples
        ]
    decode = make_decoder(config, decoder, earlier)
    with ForwardCounter(model) as counter:
        outputs = decode(HfEngine(model, tokenizer), examples, task)
    assert len(outputs) == 3
    assert sum(o.usage.fpe for o in outputs) == counter.tokens > 0
    assert all(o.usage.prefill_tokens > 0 for o in outputs)
    if decoder.startswith("reflective"):
        assert sum(o.extra["n_reflections"] for o in outputs) > 0  # the count covered hidden spans


def test_unknown_or_malformed_decoder_names_are_reported_together():
    with pytest.raises(ValueError) as info:
        check_decoder_names(["greedy", "gredy", "moi@0.5", "redumix-oracle@0.3"])
    message = str(info.value)
    assert "eval.decoders" in message and "'gredy'" in message and "'moi@0.5'" in message
    assert "redumix-oracle@0.3" not in message


@pytest.mark.skipif(not GSM8K.is_dir(), reason="shared GSM8K files not present")
def test_eval_on_real_gsm8k_writes_parseable_reports_and_resumes(tmp_path, model_dir, monkeypatch):
    overrides = [f"model.path={model_dir}", "task.name=gsm8k", f"task.gsm8k.path={GSM8K}", "eval.n=8",
                 "eval.n_other=4", *SMALL]
    config = load_config(ROOT / "recipes" / "tiny.yaml", overrides)
    run = RunDir(tmp_path)
    run_eval(config, run)
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    decoders = {row["decoder"] for row in report["rows"]}
    assert decoders == set(config.eval.decoders)
    assert {row["checkpoint"] for row in report["rows"]} == {"base"}  # no tuned model in this run folder
    for row in report["rows"]:
        assert row["n"] == (8 if row["decoder"] == "greedy" else 4)
        assert 0 <= row["ci_low"] <= row["accuracy"] <= row["ci_high"] <= 1
        for key in ("mean_tokens", "mean_fpe", "prefill_tokens", "wall_s", "tokens_per_s"):
            assert row[key] >= 0
    markdown = (tmp_path / "eval" / "report.md").read_text()
    assert all(f"| {d} |" in markdown for d in decoders)
    assert (tmp_path / "eval" / "accuracy_vs_fpe.png").read_bytes()[:4] == b"\x89PNG"
    generations = tmp_path / "eval" / "generations" / "base--greedy.jsonl"
    lines = [json.loads(x) for x in generations.read_text().splitlines()]
    assert len(lines) == 8 and all("<|reflect|>" not in x["output"] for x in lines)

    # A rerun of a complete eval is skipped, without loading the model; after losing the report it is rebuilt from
    # the records, not redone.
    before = generations.stat().st_mtime_ns
    (tmp_path / "eval" / "report.json").unlink()
    monkeypatch.setattr("redumix.pipeline.eval.open_engine", lambda *args: pytest.fail("the model was loaded"))
    run_eval(config, run)
    assert generations.stat().st_mtime_ns == before
    assert json.loads((tmp_path / "eval" / "report.json").read_text())["rows"] == report["rows"]


def test_eval_with_both_checkpoints_reports_tuned_against_base(tmp_path, model_dir):
    """The same weights as base and as tuned: every pair agrees, so greedy's change is 0 with nothing fixed or
    broken, and the table sits in report.md."""
    import shutil

    shutil.copytree(model_dir, tmp_path / "train" / "merged")
    overrides = [f"model.path={model_dir}", *SMALL, "eval.n=4", "eval.n_other=3", "eval.decoders=[greedy,sample]",
                 "eval.tuned_decoders=[greedy]"]
    run_eval(load_config(ROOT / "recipes" / "tiny.yaml", overrides), RunDir(tmp_path))
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert [r["decoder"] for r in report["tuned_vs_base"]] == ["greedy"]  # sample ran on base alone
    greedy = report["tuned_vs_base"][0]
    assert (greedy["n"], greedy["change"], greedy["fixed"], greedy["broken"]) == (4, 0, 0, 0)
    assert greedy["base_accuracy"] == greedy["tuned_accuracy"] and greedy["mcnemar_p"] == 1.0
    assert "tuned vs base (paired)" in (tmp_path / "eval" / "report.md").read_text()


def test_eval_model_evaluates_a_bare_folder_under_its_own_name(tmp_path, model_dir, monkeypatch, capsys):
    """`redumix eval --model DIR`: no harvest, train or embedded base; the report and the records carry the
    folder's name, and the run folder defaults to runs/NAME, not the recipe's."""
    import shutil

    from redumix.pipeline.cli import main

    mine = tmp_path / "models" / "my-model"
    shutil.copytree(model_dir, mine)
    monkeypatch.chdir(tmp_path)
    code = main(["eval", "--model", str(mine), "--recipe", "tiny", *SMALL, "eval.n=3", "eval.decoders=[greedy]"])
    assert code == 0, capsys.readouterr().err
    run_dir = tmp_path / "runs" / "my-model"
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert [(r["checkpoint"], r["decoder"], r["n"]) for r in report["rows"]] == [("my-model", "greedy", 3)]
    assert report["checkpoints"] == {"my-model": str(mine)} and report["tuned_vs_base"] == []
    assert (run_dir / "eval" / "generations" / "my-model--greedy.jsonl").is_file()
    assert "| my-model | greedy |" in (run_dir / "eval" / "report.md").read_text()
    assert sorted(p.name for p in run_dir.iterdir() if not p.name.startswith(".")) == ["config.yaml", "eval", "logs"]
    assert not (tmp_path / "runs" / "tiny").exists()
    # the label must not pass for the tuned model, nor name another folder
    assert main(["eval", "--recipe", "tiny", "eval.base_label=tuned"]) == 2
    assert "base_label must be a file name" in capsys.readouterr().err


TIMING = ("wall_s", "tokens_per_s")


@pytest.mark.slow
def test_two_processes_give_the_report_rows_of_one(tmp_path, model_dir):
    """`make eval NPROC=2`: the ranks split the examples and rank 0 gathers them; the report equals one process's."""
    import os
    import subprocess
    import sys

    overrides = [f"model.path={model_dir}", *SMALL, "eval.n=7", "eval.n_other=5", "eval.checkpoints=[base]",
                 "eval.decoders=[greedy,sample,redumix-oracle,vote,reflective,reflective-random]",
                 "reflective.trigger_after=[]"]
    run_eval(load_config(ROOT / "recipes" / "tiny.yaml", overrides), RunDir(tmp_path / "one"))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "redumix.pipeline.cli", "eval", "--recipe", str(ROOT / "recipes" / "tiny.yaml"),
               "--run-dir", str(tmp_path / "two"), *overrides]
    subprocess.run(command, cwd=ROOT, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)

    def rows(folder: Path) -> list[dict]:
        report = json.loads((folder / "eval" / "report.json").read_text())
        return [{k: v for k, v in row.items() if k not in TIMING} for row in report["rows"]]

    one, two = rows(tmp_path / "one"), rows(tmp_path / "two")
    assert [r["decoder"] for r in two] == ["greedy", "sample", "redumix-oracle", "vote", "reflective",
                                           "reflective-random"]
    assert two == one
    records = sorted((tmp_path / "two" / "eval" / "generations").iterdir())
    assert not [p for p in records if ".rank" in p.name]  # the parts were gathered and removed

    def untimed(path: Path) -> list[dict]:
        lines = path.read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k != "seconds"} for line in lines]

    for path in records:
        two_records, one_records = untimed(path), untimed(tmp_path / "one" / "eval" / "generations" / path.name)
        assert [without_extra(r) for r in two_records] == [without_extra(r) for r in one_records]
        # `extra` holds float diagnostics (reflective decoding's entropy deltas, a difference of two near-equal
        # entropies) that a rank's smaller batch moves by float32 rounding on some CPUs (docs/measurements.md,
        # "Tests", has the size seen). Every token, answer and count above is equal.
        for two_record, one_record in zip(two_records, one_records, strict=True):
            assert close(two_record.get("extra", {}), one_record.get("extra", {})), two_record["id"]


def without_extra(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "extra"}


def close(a: object, b: object, tolerance: float = 1e-5) -> bool:
    """Equal, but floats anywhere inside (dicts, lists) to within `tolerance`."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= tolerance
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k], tolerance) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y, tolerance) for x, y in zip(a, b, strict=True))
    return a == b
