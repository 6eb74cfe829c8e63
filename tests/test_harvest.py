import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch

from redumix.data.shards import iter_rows, shard_paths
from redumix.data.tasks import make_task
from redumix.pipeline.cli import main
from redumix.pipeline.config import load_config
from redumix.pipeline.harvest import run_harvest
from redumix.pipeline.run import RunDir
from redumix.pipeline.stats import newcombe_paired_interval
from tests.conftest import kill_when, one_thread, rows_differ

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "harvest.n=8", "harvest.shard_rows=2", "harvest.batch_size=2", "sampling.max_new_tokens=6",
    "sampling.temperature=1.0", "redumix.reflection_max_tokens=6", "redumix.topk=8",
]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir


def harvest(run_dir: Path, model_dir: Path, *extra: str) -> list[dict]:
    config = load_config(ROOT / "recipes" / "tiny.yaml", [f"model.path={model_dir}", *SMALL, *extra])
    run_harvest(config, RunDir(run_dir))
    return list(iter_rows(shard_paths(run_dir / "harvest")))


def comparable(rows: list[dict]) -> list[dict]:
    """Rows without the wall-clock timing in meta, which legitimately differs between runs."""
    out = []
    for row in rows:
        meta = json.loads(row["meta"])
        meta.pop("seconds")
        out.append({**row, "meta": meta})
    return out


def test_shards_hold_the_design_columns_and_a_valid_mixture(tmp_path, model_dir):
    rows = harvest(tmp_path, model_dir)
    assert len(rows) == 8 and len({r["id"] for r in rows}) == 8
    ds = datasets.load_dataset("arrow", data_files=[str(p) for p in shard_paths(tmp_path / "harvest")], split="train")
    assert ds.num_rows == 8
    for column in ("id", "prompt", "original", "feedback", "reflection", "redo", "redo_token_ids", "mix_topk_ids",
                   "mix_topk_logprobs", "lam", "meta", "original_correct", "redo_correct", "reference", "task"):
        assert column in ds.column_names
    for row in rows:
        assert len(row["mix_topk_ids"]) == len(row["mix_topk_logprobs"]) == len(row["redo_token_ids"]) > 0
        for lps in row["mix_topk_logprobs"]:
            assert all(a >= b for a, b in zip(lps, lps[1:], strict=False))
            assert math.fsum(math.exp(v) for v in lps) <= 1 + 1e-3  # float16 storage rounds each entry by 2**-11
        assert row["lam"] == 0.5
    manifest = json.loads((tmp_path / "harvest" / "manifest.json").read_text())
    assert manifest["rows"] == 8 and len(manifest["shards"]) == 4
    # The redo's change from the first attempt, and its paired interval, are the rows' own counts.
    right = {key: sum(bool(r[key]) for r in rows) for key in ("original_correct", "redo_correct")}
    fixed = sum(bool(r["redo_correct"] and not r["original_correct"]) for r in rows)
    broken = sum(bool(r["original_correct"] and not r["redo_correct"]) for r in rows)
    assert (manifest["fixed"], manifest["broken"]) == (fixed, broken)
    assert manifest["redo_accuracy"] - manifest["original_accuracy"] == pytest.approx(
        (right["redo_correct"] - right["original_correct"]) / 8)
    assert manifest["change_interval"] == list(newcombe_paired_interval(right["redo_correct"] - fixed, fixed, broken,
                                                                        8 - right["redo_correct"] - broken))


def test_complete_harvest_is_skipped_and_another_config_is_refused(tmp_path, model_dir, capsys):
    harvest(tmp_path, model_dir)
    before = {p.name: p.stat().st_mtime_ns for p in shard_paths(tmp_path / "harvest")}
    harvest(tmp_path, model_dir)
    assert "complete" in capsys.readouterr().out
    assert before == {p.name: p.stat().st_mtime_ns for p in shard_paths(tmp_path / "harvest")}
    with pytest.raises(ValueError, match=r"different config \(what differs: redumix\.lam: 0\.5 -> 0\.7\)"):
        harvest(tmp_path, model_dir, "redumix.lam=0.7")
    marker = json.loads((tmp_path / "harvest" / "fingerprint.json").read_text())
    assert marker["record"]["redumix"]["lam"] == 0.5 and len(marker["fingerprint"]) == 16 and marker["version"] == 1


def test_a_truncated_shard_is_named_and_only_it_is_redone(tmp_path, model_dir):
    """A finished harvest loses the second half of shard-00003.arrow: train and export name it, and the harvest
    rerun redoes that shard alone, back to the same rows."""
    from redumix.pipeline.export import run_export
    from redumix.pipeline.train import run_train

    expected = comparable(harvest(tmp_path, model_dir))
    folder = tmp_path / "harvest"
    damaged = folder / "shard-00003.arrow"
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    others = {p.name: p.stat().st_mtime_ns for p in shard_paths(folder) if p != damaged}
    config = load_config(ROOT / "recipes" / "tiny.yaml", [f"model.path={model_dir}", *SMALL])
    for stage in (run_train, run_export):
        with pytest.raises(ValueError, match=r"shard-00003\.arrow.*run `redumix harvest` again"):
            stage(config, RunDir(tmp_path))
    assert comparable(harvest(tmp_path, model_dir)) == expected
    assert others == {p.name: p.stat().st_mtime_ns for p in shard_paths(folder) if p != damaged}


def test_a_damaged_shard_of_an_unfinished_harvest_is_redone(tmp_path, model_dir):
    expected = comparable(harvest(tmp_path, model_dir))
    folder = tmp_path / "harvest"
    (folder / "manifest.json").unlink()  # as if the run had died before it finished
    damaged = folder / "shard-00001.arrow"
    damaged.write_bytes(damaged.read_bytes()[:-40])
    assert comparable(harvest(tmp_path, model_dir)) == expected


def test_a_foreign_shard_with_the_right_row_count_is_redone_and_named(tmp_path, model_dir, capsys):
    """Before the manifest exists, a shard is taken in only when its rows' own fingerprint is this run's."""
    harvest(tmp_path / "other", model_dir, "redumix.lam=0.7")
    expected = comparable(harvest(tmp_path / "mine", model_dir))
    folder = tmp_path / "mine" / "harvest"
    (folder / "manifest.json").unlink()  # as if the run had died before it finished
    foreign = tmp_path / "other" / "harvest" / "shard-00001.arrow"
    (folder / "shard-00001.arrow").write_bytes(foreign.read_bytes())  # same row count, another λ
    capsys.readouterr()
    assert comparable(harvest(tmp_path / "mine", model_dir)) == expected
    out = capsys.readouterr().out
    assert "shard-00001.arrow was made with another config" in out and "shard-00000.arrow" not in out


def test_a_batch_of_several_shards_gives_the_rows_of_one_shard_at_a_time(tmp_path, model_dir):
    """batch_size over shard_rows decodes whole shards together (here three of two rows, then the last alone); each
    shard is written whole, its rows those of a shard-sized batch, and a lost shard is redone alone."""
    alone = comparable(harvest(tmp_path / "alone", model_dir))  # batch 2 = shard_rows 2
    together = harvest(tmp_path / "together", model_dir, "harvest.batch_size=6")
    assert rows_differ(comparable(together), alone) == []  # the stored floats to their tolerance (batch rounding)
    batch_seconds = [json.loads(r["meta"])["seconds"] for r in together]  # a batch's time over its rows
    assert len(set(batch_seconds[:6])) == 1 and batch_seconds[6] != batch_seconds[0]  # shards 0-2 in one batch
    (tmp_path / "together" / "harvest" / "shard-00002.arrow").unlink()
    assert rows_differ(comparable(harvest(tmp_path / "together", model_dir, "harvest.batch_size=6")), alone) == []
    three = harvest(tmp_path / "three", model_dir, "harvest.n=3", "harvest.attempts=3", "harvest.batch_size=4")
    three_alone = harvest(tmp_path / "three-alone", model_dir, "harvest.n=3", "harvest.attempts=3")
    assert rows_differ(comparable(three), comparable(three_alone)) == []


def test_killed_harvest_resumes_to_the_same_rows(tmp_path, model_dir):
    # Both processes run on one thread: the killed one writes some shards and this one the rest, and float32 results
    # depend on the thread count (CI once saw a tail log-prob differ in its 7th digit between the two processes).
    with one_thread():
        expected = comparable(harvest(tmp_path / "whole", model_dir))
    run_dir = tmp_path / "killed"
    command = [sys.executable, "-m", "redumix.pipeline.cli", "harvest",
               "--recipe", str(ROOT / "recipes" / "tiny.yaml"),
               "--run-dir", str(run_dir), f"model.path={model_dir}", *SMALL]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    written = random.randint(1, 3)  # of 4 shards: killed inside a later one
    kill_when(process, lambda: len(shard_paths(run_dir / "harvest")) >= written, timeout=120)
    with one_thread():
        resumed = comparable(harvest(run_dir, model_dir))
    assert resumed == expected
    leftovers = [p for p in (run_dir / "harvest").iterdir() if p.name.endswith(".tmp")]
    assert len(leftovers) <= 1  # at most the torn temporary file of the killed write, never a torn shard


def test_human_feedback_file_errors_name_file_and_line(tmp_path, model_dir):
    bad = tmp_path / "feedback.jsonl"
    bad.write_text('{"id": "arith-train-000000", "feedback": "Check step 2."}\n{"id": oops}\n')
    with pytest.raises(ValueError, match=r"feedback.jsonl:2: not valid JSON"):
        harvest(tmp_path / "run", model_dir, "redumix.feedback=human", f"redumix.feedback_file={bad}")


def test_cli_reports_unknown_keys_and_missing_model(tmp_path, capsys):
    assert main(["harvest", "--recipe", str(ROOT / "recipes/tiny.yaml"), "--run-dir", str(tmp_path),
                 "harvest.lamda=0.3", "redumix.lam=2"]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'harvest.lamda'" in err and "lam must be in [0, 1]" in err and "command line" in err
    assert main(["harvest", "--recipe", str(ROOT / "recipes/tiny.yaml"), "--run-dir", str(tmp_path),
                 f"model.path={tmp_path / 'nowhere'}"]) == 2
    assert "command line: 'model.path' = " in capsys.readouterr().err


@pytest.mark.slow
def test_two_processes_harvest_the_same_rows_as_one(tmp_path, model_dir):
    # The ranks run on one thread each; so does the one-process reference, because on some CPUs (an AMD EPYC host
    # here) MKL's float32 results depend on the thread count, enough to flip a sampled token.
    with one_thread():
        expected = comparable(harvest(tmp_path / "one", model_dir))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "redumix.pipeline.cli", "harvest", "--recipe", str(ROOT / "recipes" / "tiny.yaml"),
               "--run-dir", str(tmp_path / "two"), f"model.path={model_dir}", *SMALL]
    subprocess.run(command, cwd=ROOT, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
    assert rows_differ(comparable(list(iter_rows(shard_paths(tmp_path / "two" / "harvest")))), expected) == []


def test_the_redo_instruction_and_temperature_are_the_harvests_levers(tmp_path, model_dir):
    """The protocol a ladder chooses is frozen in the recipe's redumix section, and the harvest decodes it: x2 ends
    with the chosen instruction, and only the redo is drawn at redo_temperature (the attempt stays greedy)."""
    from transformers import AutoTokenizer

    from redumix.data.prompts import REDO_INSTRUCTIONS

    greedy = ["sampling.temperature=0.0"]
    plain = harvest(tmp_path / "plain", model_dir, *greedy)
    answer = harvest(tmp_path / "answer", model_dir, *greedy, "redumix.instruction=answer")
    sampled = harvest(tmp_path / "sampled", model_dir, *greedy, "redumix.instruction=answer",
                      "redumix.redo_temperature=1.0")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = lambda ids: tokenizer.decode(ids).replace(" ", "")  # noqa: E731 (the test tokenizer has no spaces)
    for a, b, c in zip(plain, answer, sampled, strict=True):
        assert (a["id"], a["original"], a["reflection"]) == (b["id"], b["original"], b["reflection"])
        assert text(a["x2_token_ids"]).endswith(REDO_INSTRUCTIONS["redo"].replace(" ", "") + "<|end|><|assistant|>")
        assert text(b["x2_token_ids"]).endswith(REDO_INSTRUCTIONS["answer"].replace(" ", "") + "<|end|><|assistant|>")
        assert (c["original"], c["x2_token_ids"]) == (b["original"], b["x2_token_ids"])
    assert any(b["redo"] != c["redo"] for b, c in zip(answer, sampled, strict=True))  # the redo alone is drawn
    settings = json.loads((tmp_path / "sampled" / "harvest" / "fingerprint.json").read_text())["record"]
    assert settings["redumix"]["instruction"] == "answer" and settings["redumix"]["redo_temperature"] == 1.0


def test_greedy_attempts_of_a_problem_share_their_stages_and_give_the_rows_decoded_alone(tiny_chat_model):
    """With a greedy attempt, critique and reflection, a problem's attempts differ only in the redo: a batch decodes
    stages 1-3 once per problem in it, and each row is the row decoded on its own, with its own redo."""
    from redumix.generate.accounting import ForwardCounter
    from redumix.generate.hf_engine import HfEngine
    from redumix.generate.redumix import redumix_generate
    from redumix.pipeline.harvest import feedback_fn, redo_batch, seed_key

    model, tokenizer = tiny_chat_model
    config = load_config(ROOT / "recipes" / "tiny.yaml", [*SMALL, "sampling.temperature=0.0", "harvest.attempts=3",
                                                          "redumix.redo_temperature=1.0"])
    task = make_task(config.task, config.seed)
    first, second = task.examples("train", 2)
    batch, tries = [first, first, first, second, second], [0, 1, 2, 0, 1]  # the third of `second` is the next batch's
    engine = HfEngine(model, tokenizer)
    with torch.no_grad(), ForwardCounter(model) as shared_count:
        shared = redo_batch(engine, config, task, batch, tries)
    with torch.no_grad(), ForwardCounter(model) as alone_count:
        alone = [redumix_generate(engine, [e.prompt], [seed_key(e.id, j)], config.redumix, config.sampling,
                                  config.seed, feedback_fn(config, task, [e]))[0]
                 for e, j in zip(batch, tries, strict=True)]
    for s, a in zip(shared, alone, strict=True):
        assert (s.original, s.feedback, s.reflection, s.redo_token_ids, s.topk_ids, s.x2_ids) == (
            a.original, a.feedback, a.reflection, a.redo_token_ids, a.topk_ids, a.x2_ids)
        torch.testing.assert_close(torch.tensor(s.topk_logprobs), torch.tensor(a.topk_logprobs), atol=1e-5, rtol=0)
        assert s.usage == a.usage  # each row counts what its row cost alone
    assert len({tuple(r.redo_token_ids) for r in shared[:3]}) > 1  # three redos of one attempt
    assert shared_count.tokens < alone_count.tokens  # the stages of two problems decoded once each, not five times


def test_attempts_harvest_each_example_that_many_times_the_first_as_a_one_attempt_harvest(tmp_path, model_dir):
    """`harvest.attempts` multiplies the rows of a small split: example i's attempts are rows [i·a, (i+1)·a), the
    first drawn with the one-attempt harvest's seeds, the others with their own; a rerun skips the complete folder."""
    one = harvest(tmp_path / "one", model_dir, "harvest.n=4")
    three = harvest(tmp_path / "three", model_dir, "harvest.n=4", "harvest.attempts=3")
    assert [r["id"] for r in three] == [r["id"] for r in one for _ in range(3)]
    columns = ("original", "reflection", "redo", "redo_token_ids", "mix_topk_ids", "mix_topk_logprobs")
    for i, row in enumerate(one):
        first, *others = three[3 * i : 3 * i + 3]
        assert all(first[c] == row[c] for c in columns)
        assert [json.loads(r["meta"])["attempt"] for r in (first, *others)] == [0, 1, 2]
    assert any(three[3 * i]["original"] != three[3 * i + j]["original"] for i in range(4) for j in (1, 2))
    manifest = json.loads((tmp_path / "three" / "harvest" / "manifest.json").read_text())
    assert (manifest["rows"], manifest["attempts"]) == (12, 3)
    record = json.loads((tmp_path / "three" / "harvest" / "fingerprint.json").read_text())["record"]
    assert record["harvest"]["attempts"] == 3
    assert "attempts" not in json.loads((tmp_path / "one" / "harvest" / "fingerprint.json").read_text())["record"][
        "harvest"]  # a one-attempt harvest's record is the one made before the key existed
    with pytest.raises(ValueError, match=r"harvest.attempts=2 would harvest the same greedy row 2 times"):
        load_config(ROOT / "recipes" / "tiny.yaml", ["harvest.attempts=2", "sampling.temperature=0.0"])
