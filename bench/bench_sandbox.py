"""The code task's sandbox: programs graded a second (`make bench`, or `python -m bench.bench_sandbox` alone).

  sandbox_programs_per_s_{W}w    1,000 short programs (half pass; the rest fail by a wrong value, an exception or an
                                 early os._exit), one assert each, on W parallel workers: W = 1 and W = the cores
  sandbox_seconds_1000_{W}w      the wall time of that batch
  sandbox_mbpp_per_s_{W}w        MBPP's reference solutions (test split, the first 200) against their three asserts,
                                 on the cores: the programs the task grades, not toy ones
  sandbox_start_ms               a trivial program's median wall time alone (interpreter, isolation, fork, one call)
  sandbox_isolation              the layers this host gave (uid, namespaces, Landlock, seccomp)

Each program is its own `python -I -S` judge with a forked runner (data/sandbox.py), so the cost is mostly the
interpreter's start; the numbers say how long grading adds to a harvest or an eval on this host. The host's load is
not controlled here: run it on a quiet machine, twice, and keep both (docs/code.md).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from redumix.data.code import CodeConfig, CodeTask
from redumix.data.sandbox import Limits, Program, isolation, run_batch, run_one

MBPP = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mbpp" / "mbpp.jsonl"
BODIES = ["def f(x):\n    return x * 2\n", "def f(x):\n    return x\n", "def f(x):\n    raise KeyError(x)\n",
          "import os\nos._exit(0)\n"]


def toy_programs(n: int) -> list[Program]:
    """Half pass, the other half fail in three ways; what passes is checked."""
    return [Program(BODIES[0] if i % 2 == 0 else BODIES[1 + i % 3], (f"assert f({i}) == {2 * i}",)) for i in range(n)]


def timed_batch(programs: list[Program], workers: int) -> tuple[float, list[bool]]:
    began = time.perf_counter()
    outcomes = run_batch(programs, Limits(timeout_s=10.0), workers)
    return time.perf_counter() - began, [o.passed for o in outcomes]


def run() -> dict[str, object]:
    cores = os.cpu_count() or 1
    results: dict[str, object] = {"sandbox_isolation": ", ".join(f"{k} {v}" for k, v in isolation().items())}
    starts = [run_one(Program("def f():\n    return 1\n", ("assert f() == 1",))).seconds for _ in range(9)]
    results["sandbox_start_ms"] = round(1000 * statistics.median(starts), 1)
    programs = toy_programs(1000)
    for workers in sorted({1, cores}):
        seconds, passed = timed_batch(programs, workers)
        if passed != [i % 2 == 0 for i in range(1000)]:
            raise RuntimeError("the sandbox graded a toy program wrongly; see tests/test_sandbox.py")
        results[f"sandbox_seconds_1000_{workers}w"] = round(seconds, 1)
        results[f"sandbox_programs_per_s_{workers}w"] = round(1000 / seconds, 1)
    if MBPP.is_file():
        task = CodeTask(CodeConfig(mbpp_path=str(MBPP), workers=cores))
        examples = task.examples("test", 200)
        solutions = task.solutions("test", 200)
        began = time.perf_counter()
        outcomes = task.grade_many([solutions[e.id] for e in examples], examples)
        seconds = time.perf_counter() - began
        results[f"sandbox_mbpp_per_s_{cores}w"] = round(len(examples) / seconds, 1)
        results[f"sandbox_mbpp_passed_{cores}w"] = sum(o.passed for o in outcomes)
    return results


if __name__ == "__main__":
    for key, value in run().items():
        print(f"{key}: {value}")
