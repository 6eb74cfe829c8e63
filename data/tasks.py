"""The one place that picks a task by name. A new task is a class in its own module and one line here."""

from __future__ import annotations

from redumix.data.arith import ArithTask
from redumix.data.gsm8k import Gsm8kTask
from redumix.data.task import Task, TaskConfig


def make_task(config: TaskConfig, seed: int) -> Task:
    """The task of `config`. `seed` picks generated problems (arith); a task read from files ignores it."""
    if config.name == "arith":
        return ArithTask(config, seed)
    if config.name == "gsm8k":
        return Gsm8kTask(config)
    raise ValueError(f"task.name: unknown task {config.name!r} (known: arith, gsm8k)")
