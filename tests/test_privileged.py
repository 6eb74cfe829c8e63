"""`redumix.feedback=reference`: the code task's reference solution shown in x2 as privileged context (SDFT's),
for harvests on train problems only. A task without references, a test split and eval's decoders refuse it."""

from __future__ import annotations

from pathlib import Path

import pytest

from redumix.data.tasks import TaskConfig, make_task
from redumix.generate.policy import SamplingPolicy
from redumix.generate.redumix import RedumixConfig, RedumixDecoder, task_feedback
from redumix.pipeline.config import load_config
from redumix.pipeline.harvest import run_harvest
from redumix.pipeline.run import RunDir

WRONG = "```python\ndef nothing():\n    return None\n```"
MBPP = Path(__file__).resolve().parents[2] / "shared" / "data" / "mbpp" / "mbpp.jsonl"  # where task.code reads it


@pytest.mark.skipif(not MBPP.is_file(), reason=f"MBPP is read from {MBPP}, which is absent")
def test_reference_feedback_shows_the_solution_on_train_problems_and_refuses_test_ones():
    task = make_task(TaskConfig(name="code"), seed=0)
    train = task.examples("train", 2)
    solutions = task.solutions("train", 2)
    feedback = task_feedback("reference", task, train, seed=0)
    for i, example in enumerate(train):
        shown = feedback(i, WRONG)
        assert task.feedback(WRONG, example) in shown  # the verifier's verdict first
        assert solutions[example.id].strip("`\npython") in shown  # then the reference itself
    test = task.examples("test", 1)
    with pytest.raises(ValueError, match="train problems only"):
        task_feedback("reference", task, test, seed=0)(0, WRONG)
    # the verifier alone never shows it
    assert solutions[train[0].id].strip("`\npython") not in task.feedback(WRONG, train[0])


def test_a_task_without_references_refuses_reference_feedback():
    arith = make_task(TaskConfig(), seed=0)
    with pytest.raises(ValueError, match="task 'arith' has none to show"):
        task_feedback("reference", arith, arith.examples("train", 1), seed=0)


def test_eval_and_a_test_split_harvest_refuse_it(tmp_path):
    decoder = RedumixDecoder("redumix-oracle", RedumixConfig(feedback="reference"), SamplingPolicy(), 0)
    with pytest.raises(ValueError, match="for harvests on train problems"):
        decoder(None, [], make_task(TaskConfig(name="code"), seed=0))  # type: ignore[arg-type]
    config = load_config("tiny", ["redumix.feedback=reference", "harvest.split=test", "harvest.n=2"])
    with pytest.raises(ValueError, match="harvest.split=train"):
        run_harvest(config, RunDir(tmp_path / "run"))
    assert not (tmp_path / "run" / "harvest").exists()
