"""Which process this is (rank and world size from torchrun's environment), printing from rank 0, joining the process
group, and this process's peak memory. Imports nothing of redumix."""

from __future__ import annotations

import os
from typing import Any


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def print0(*args: Any, **kwargs: Any) -> None:
    if rank() == 0:
        print(*args, **kwargs, flush=True)


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (Linux reports KiB, macOS bytes)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)


def init_distributed() -> None:
    """Join the process group when launched with several ranks (torchrun / accelerate); gloo works on CPU."""
    import torch.distributed as dist

    if world_size() > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if _cuda() else "gloo")


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
