"""gpu-check's rows and the runner that fits them into a lease: each row printed and written to the JSON as soon as it
is done, `--only` to run some checks, and a budget in seconds past which no row starts (a skipped check says so).

A check is a generator of rows: the runner asks it for its next row only while the budget lasts, so a check of
several rows (a model shape, then another) stops between them. A lease that ends early keeps every finished row.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from redumix.common.files import atomic_write_json


@dataclass(frozen=True)
class Size:
    examples: int  # problems per check
    tokens: int  # new tokens a stage (attempt, reflection, redo)
    repeats: int  # timed passes per throughput figure
    batch: int  # the correctness checks' batch
    batches: tuple[int, ...]  # the throughput and decode-step rows' batches
    step_tokens: tuple[int, int]  # decode-step rows: two loop lengths, whose difference gives one step's time


FULL = Size(examples=64, tokens=64, repeats=1, batch=16, batches=(16, 64), step_tokens=(16, 80))
SMOKE = Size(examples=4, tokens=6, repeats=1, batch=4, batches=(4,), step_tokens=(4, 12))


@dataclass
class Row:
    check: str
    model: str
    setting: str
    result: str
    ok: bool | None  # None: a measurement, with nothing to pass or fail
    seconds: float | None = None  # how long the row took, its model's building included (the runner sets it)


Check = Callable[[], Iterable[Row]]  # a generator, so that the runner can stop between rows, or a list


def table(rows: list[Row]) -> str:
    verdict = {True: "ok", False: "FAILED", None: "–"}
    lines = ["| check | model | setting | result | verdict | s |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.check} | {r.model} | {r.setting} | {r.result} | {verdict[r.ok]} | "
              f"{'' if r.seconds is None else f'{r.seconds:.0f}'} |" for r in rows]
    return "\n".join(lines)


def pick(checks: dict[str, Check], only: str | None) -> dict[str, Check]:
    """The checks that `--only` names (comma-separated), in the table's order; all of them without it."""
    if not only:
        return checks
    names = [name.strip() for name in only.split(",") if name.strip()]
    unknown = [name for name in names if name not in checks]
    if unknown:
        raise SystemExit(f"gpu-check: unknown check {', '.join(unknown)}; known: {', '.join(checks)}")
    return {name: check for name, check in checks.items() if name in names}


def run_checks(checks: dict[str, Check], budget_s: float | None = None, json_path: Path | None = None,
               clock: Callable[[], float] = time.perf_counter) -> list[Row]:
    """Every check's rows, each printed and (with `json_path`) written out with all before it as soon as it is done.
    No row starts once `budget_s` seconds have passed: the check it belonged to, and every check after, gets one
    row that says it was skipped and when."""
    began, rows = clock(), []
    last = began

    def done(row: Row) -> None:
        nonlocal last
        row.seconds, last = clock() - last, clock()
        rows.append(row)
        print(table([row]).splitlines()[-1], flush=True)
        if json_path is not None:
            atomic_write_json(json_path, [r.__dict__ for r in rows])

    for name, check in checks.items():
        found = None
        while True:
            elapsed = clock() - began
            if budget_s is not None and elapsed > budget_s:
                done(Row(name, "–", "–", f"skipped: {elapsed:.0f} s had passed, past the budget of {budget_s:g} s",
                         None))
                break
            found = found or iter(check())  # a check that returns a list does its work here
            row = next(found, None)
            if row is None:
                break
            done(row)
    return rows
