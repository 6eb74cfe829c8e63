"""The splits of a generated task, one rule for every task that draws its problems from a seed.

A problem has a canonical form (its `key`: what makes it the same problem, whatever the wording). The key falls into
one of `BUCKETS` buckets by a stable hash, and a split is a set of buckets, so a problem is in one split only,
whatever the seed. `distinct_problems` is the seeded stream of a split's distinct problems. arith (its test and train
buckets, the others for the embedded model's pre-training) and constraints (bucket 0 for test, the rest for train)
draw through it.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import TypeVar

BUCKETS = 10
MAX_MISSES = 100_000  # draws in a row with no new problem before a stream gives up

P = TypeVar("P")


def bucket(key: str) -> int:
    """The bucket of a canonical form: its SHA-256's first 8 bytes, mod BUCKETS (the same in every process)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % BUCKETS


def split_buckets(task: str, split: str, splits: Mapping[str, Collection[int]]) -> Collection[int]:
    """The buckets of `split` in a task's table of splits, or an error naming the task's splits."""
    if split not in splits:
        known = " and ".join(repr(name) for name in sorted(splits, reverse=True))
        raise ValueError(f"{task} has splits {known}, not {split!r}")
    return splits[split]


def distinct_problems(
    task: str,
    stream: str,
    seed: int,
    buckets: Collection[int],
    draw: Callable[[random.Random], P],
    key: Callable[[P], str],
    settings: str,
    keep: Callable[[P], bool] | None = None,
) -> Iterator[P]:
    """An endless, seeded stream of distinct problems whose key falls into `buckets`, drawn by `draw`; `keep` may
    throw more away (a contradiction). `settings` names the task's settings in the error raised when they allow too
    few distinct problems (MAX_MISSES draws in a row with none new)."""
    rng = random.Random(f"{task}:{stream}:{seed}")  # str seeds hash with SHA-512: stable across processes
    seen: set[str] = set()
    misses = 0
    while True:
        problem = draw(rng)
        name = key(problem)
        if bucket(name) in buckets and name not in seen and (keep is None or keep(problem)):
            seen.add(name)
            misses = 0
            yield problem
            continue
        misses += 1
        if misses > MAX_MISSES:
            raise ValueError(f"{task}: found no new {stream!r} problem in {MAX_MISSES} draws after {len(seen)}; "
                             f"{settings} allow too few distinct problems")
