"""`make bench`: run every benchmark and write bench/results.json, one key per ratio, then print it.

Before the first module runs, every module's `inputs()` (what it reads from outside the checkout: a model folder,
a data set) is checked, and a missing one stops the bench at once, naming it and how to get it. Each module's keys
are written to the file as soon as it finishes, with `modules` naming those done, so a run that stops keeps what it
measured.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

from bench import bench_decode, bench_peers, bench_real, bench_reflective, bench_sandbox, bench_train, bench_vllm
from redumix.common.files import atomic_write_json, json_text

RESULTS = Path(__file__).with_name("results.json")
MODULES = (bench_decode, bench_train, bench_reflective, bench_peers, bench_real, bench_vllm, bench_sandbox)


def missing_inputs(modules: Sequence[ModuleType]) -> list[str]:
    """Each module's inputs (`inputs()`: (path, how to get it) pairs, where a module has any) that are not there."""
    return [f"{module.__name__} reads {path}, which is not there ({how})"
            for module in modules for path, how in getattr(module, "inputs", list)() if not Path(path).exists()]


def main(modules: Sequence[ModuleType] = MODULES, path: Path = RESULTS) -> None:
    missing = missing_inputs(modules)
    if missing:
        raise SystemExit("bench: nothing was run: " + "; ".join(missing))
    results: dict[str, object] = {}
    done: list[str] = []
    for module in modules:
        began = time.perf_counter()
        results.update(module.run())
        print(f"{module.__name__}: {time.perf_counter() - began:.0f} s", flush=True)
        done.append(module.__name__.removeprefix("bench."))
        for key in ("machine", "modules"):  # last in the file, after every key so far
            results.pop(key, None)
        results["machine"] = f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
        results["modules"] = ", ".join(done)
        atomic_write_json(path, results)
    print(json_text(results, indent=2))


if __name__ == "__main__":
    main()
