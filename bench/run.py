"""`make bench`: run every benchmark and write bench/results.json, one key per ratio, then print it."""

from __future__ import annotations

import platform
import time
from pathlib import Path

import torch

from bench import bench_decode, bench_peers, bench_real, bench_reflective, bench_sandbox, bench_train, bench_vllm
from redumix.common.files import atomic_write_json, json_text

RESULTS = Path(__file__).with_name("results.json")


def main() -> None:
    results: dict[str, object] = {}
    for module in (bench_decode, bench_train, bench_reflective, bench_peers, bench_real, bench_vllm):
        began = time.perf_counter()
        results.update(module.run())
        print(f"{module.__name__}: {time.perf_counter() - began:.0f} s", flush=True)
MODULES = (bench_decode, bench_train, bench_reflective, bench_peers, bench_real, bench_vllm, bench_sandbox)


def missing_inputs(modules: Sequence[ModuleType]) -> list[str]:
    """Each module's inputs (`inputs()`: (path, how to get it) pairs, where a module has any) that are not there."""
    return [f"{module.__name__} reads {path}, which is not there ({how})"
            for module in modules for path, how in getattr(module, "inputs", list)() if not Path(path).exists()]
    results["machine"] = f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    atomic_write_json(RESULTS, results)
    print(json_text(results, indent=2))


if __name__ == "__main__":
    main()
