"""The two seams: a decoder or a task defined outside the library goes through eval and harvest by the public
interface alone, with no edit to pipeline/."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from redumix.data.shards import iter_rows, shard_paths
from redumix.data.task import Example
from redumix.generate.accounting import Usage
from redumix.generate.decoder import Decoded
from redumix.pipeline.config import load_config
from redumix.pipeline.decoders import DECODERS, DecoderEntry
from redumix.pipeline.eval import run_eval
from redumix.pipeline.harvest import run_harvest
from redumix.pipeline.run import RunDir

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "sampling.max_new_tokens=6", "redumix.reflection_max_tokens=5", "redumix.critique_max_tokens=4",
    "eval.batch_size=2", "harvest.n=6", "harvest.shard_rows=3", "harvest.batch_size=2", "redumix.topk=4",
]


# --- a toy decoder: answer with the first number of the prompt ------------------------------------------------------


@dataclass
class FirstNumber:
    """Reads no model output: it answers with the first number in the prompt (the arith start value)."""

    name: str
    template: str = "The answer is {}."

    needs_hf_engine = False

    def __call__(self, engine, examples, task) -> list[Decoded]:
        out = []
        for example in examples:
            text = self.template.format(re.search(r"\d+", example.prompt).group())
            ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
            out.append(Decoded(text, ids, Usage(visible_tokens=len(ids)), {"source": "prompt"}))
        return out


def test_a_decoder_from_a_test_file_reaches_the_eval_report(tmp_path, tiny_model_dir):
    config = load_config(ROOT / "recipes" / "tiny.yaml", [
        f"model.path={tiny_model_dir}", *SMALL, "eval.n=5", "eval.n_other=7", "eval.decoders=[greedy, first-number]",
    ])
    decoders = {**DECODERS, "first-number": DecoderEntry(None, lambda c, name, earlier: FirstNumber(name), "", "toy")}
    run_eval(config, RunDir(tmp_path), decoders=decoders)

    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    [row] = [r for r in report["rows"] if r["decoder"] == "first-number"]
    records = [json.loads(x) for x in (tmp_path / "eval" / "generations" / "base--first-number.jsonl").open()]
    assert row["n"] == len(records) == 7
    expected = [re.search(r"\d+", r["prompt"]).group() == r["reference"] for r in records]
    assert [r["correct"] for r in records] == expected  # graded by the task, not by the decoder
    assert row["accuracy"] == sum(expected) / 7
    assert all(r["extra"] == {"source": "prompt"} and r["fpe"] == 0 for r in records)
    assert "| first-number |" in (tmp_path / "eval" / "report.md").read_text()

    # The decoder's settings are its fingerprint: a changed template invalidates its records, and only its own.
    decoders["first-number"] = DecoderEntry(None, lambda c, name, earlier: FirstNumber(name, template="#### {}"), "",
                                            "toy")
    (tmp_path / "eval" / "report.json").unlink()
    greedy_file = tmp_path / "eval" / "generations" / "base--greedy.jsonl"
    before = greedy_file.stat().st_mtime_ns
    run_eval(config, RunDir(tmp_path), decoders=decoders)
    records = [json.loads(x) for x in (tmp_path / "eval" / "generations" / "base--first-number.jsonl").open()]
    assert all(r["output"].startswith("#### ") for r in records)
    assert greedy_file.stat().st_mtime_ns == before


# --- a toy task: echo the number ------------------------------------------------------------------------------------


class EchoTask:
    """Repeat a number. Its grader and feedback are its own: the completion must hold the number as a whole word."""

    name = "echo"

    def examples(self, split, n):
        offset = 0 if split == "test" else 1000
        return [Example(f"echo-{split}-{i}", "echo", f"Repeat {offset + 7 * i + 3}", str(offset + 7 * i + 3))
                for i in range(n)]

    def answer(self, text):
        found = re.findall(r"\d+", text)
        return found[0] if found else None

    def is_correct(self, text, example):
        return example.reference in re.findall(r"\d+", text)

    def feedback(self, text, example):
        return "Echo: right." if self.is_correct(text, example) else "Echo: not the number I said."


def test_a_task_from_a_test_file_runs_through_harvest_and_eval(tmp_path, tiny_model_dir):
    config = load_config(ROOT / "recipes" / "tiny.yaml", [
        f"model.path={tiny_model_dir}", *SMALL, "eval.n=4", "eval.n_other=2", "eval.decoders=[greedy, redumix-oracle]",
    ])
    task = EchoTask()
    run_harvest(config, RunDir(tmp_path), task=task)
    rows = list(iter_rows(shard_paths(tmp_path / "harvest")))
    assert [r["id"] for r in rows] == [e.id for e in task.examples("train", 6)]
    for row, example in zip(rows, task.examples("train", 6), strict=True):
        assert row["task"] == "echo" and row["prompt"] == example.prompt
        assert row["original_correct"] == task.is_correct(row["original"], example)
        assert row["redo_correct"] == task.is_correct(row["redo"], example)
        assert row["feedback"] == task.feedback(row["original"], example)  # the task's verifier, not arith's

    run_eval(config, RunDir(tmp_path), task=task)
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["task"] == "echo"
    assert {(r["decoder"], r["n"]) for r in report["rows"]} == {("greedy", 4), ("redumix-oracle", 2)}
    records = [json.loads(x) for x in (tmp_path / "eval" / "generations" / "base--redumix-oracle.jsonl").open()]
    by_id = {e.id: e for e in task.examples("test", 2)}
    for record in records:
        example = by_id[record["id"]]
        assert record["correct"] == task.is_correct(record["output"], example)
        assert record["answer"] == task.answer(record["output"])
        assert record["extra"]["feedback"] == task.feedback(record["extra"]["original"], example)
