"""The tasks by name. A new task is a class in its own module of data/ (with its settings dataclass, if it has any)
and one line in `TASKS`.

The `task` config section is written here: `task.name` picks the task, `task.prompt_suffix` applies to every task,
and each task with settings has its own section under its name (`task.arith.steps_max`, `task.gsm8k.path`): a field
of `TaskConfig`. The choices of `task.name` and its "known:" message are read from the table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redumix.data.arith import ArithConfig, ArithTask
from redumix.data.code import CodeConfig, CodeTask
from redumix.data.constraints import ConstraintsConfig, ConstraintsTask
from redumix.data.gsm8k import Gsm8kConfig, Gsm8kTask
from redumix.data.task import Task


@dataclass(frozen=True)
class TaskEntry:
    settings: type | None  # the dataclass of its section `task.<name>`, or None when it has no settings
    make: Callable[[Any, int, str], Task]  # (its settings or None, seed, prompt_suffix) -> the task
    help: str


TASKS: dict[str, TaskEntry] = {
    "arith": TaskEntry(ArithConfig, ArithTask, "generated multi-step arithmetic word problems (data/arith.py)"),
    "gsm8k": TaskEntry(Gsm8kConfig, Gsm8kTask, "grade-school math word problems from JSON Lines (data/gsm8k.py)"),
    "constraints": TaskEntry(ConstraintsConfig, ConstraintsTask, "IFEval-style instructions (data/constraints.py)"),
    "code": TaskEntry(CodeConfig, CodeTask, "MBPP and HumanEval, their tests run in a sandbox (data/code.py)"),
}


@dataclass
class TaskConfig:
    """`task`: which task, a suffix for every prompt, and each task's own settings under its name. A task with settings
    is one field here and one `TASKS` line (tests/test_extending.py checks that every line's settings are a field)."""

    name: str = field(default="arith", metadata={"help": "Task to harvest and evaluate: " + "; ".join(
        f"{name}: {entry.help}" for name, entry in TASKS.items())})
    prompt_suffix: str = field(default="", metadata={
        "help": "Text appended to every question, e.g. an answer-format instruction for a real model."})
    arith: ArithConfig = field(default_factory=ArithConfig, metadata={"help": "arith's settings"})
    gsm8k: Gsm8kConfig = field(default_factory=Gsm8kConfig, metadata={"help": "gsm8k's settings"})
    constraints: ConstraintsConfig = field(
        default_factory=ConstraintsConfig, metadata={"help": "constraints' settings"})
    code: CodeConfig = field(default_factory=CodeConfig, metadata={"help": "code's settings"})

    def __post_init__(self) -> None:
        _check_name(self)  # the name is checked against the table when it is read


def _check_name(config: TaskConfig) -> None:
    if config.name not in TASKS:
        raise ValueError(f"unknown task name {config.name!r} (known: {', '.join(TASKS)})")


def make_task(config: TaskConfig, seed: int) -> Task:
    """The task of `config`. `seed` picks generated problems (arith); a task read from files ignores it."""
    _check_name(config)
    entry = TASKS[config.name]
    settings = getattr(config, config.name) if entry.settings is not None else None
    return entry.make(settings, seed, config.prompt_suffix)


def task_record(config: TaskConfig) -> dict[str, Any]:
    """What decides a task's problems and prompts, for the fingerprints (common/fingerprints.py): its name, the
    prompt suffix and the named task's own section, whole (its settings define its problems). No other task's
    section: adding a task, or changing another task's settings, moves no fingerprint of this one's runs. A setting
    added later whose default draws what came before it (metadata `"record": "at_default_left_out"`) is left out at
    that default, so the runs made before it keep their fingerprints."""
    entry = TASKS[config.name]
    if entry.settings is None:
        return {"name": config.name, "prompt_suffix": config.prompt_suffix, "settings": None}
    section = getattr(config, config.name)
    settings = dataclasses.asdict(section)
    for f in dataclasses.fields(section):
        if f.metadata.get("record") == "at_default_left_out" and getattr(section, f.name) == f.default:
            del settings[f.name]
    return {"name": config.name, "prompt_suffix": config.prompt_suffix, "settings": settings}
