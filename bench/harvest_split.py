"""Where the whole harvest's time goes, ours and the user's `generate` loop (`python -m bench.harvest_split`): each
side's forward time split into prefills (more than one new position a call) and one-token decode calls, and the
wall time left outside the forwards. Not a ratio, so not in `make bench`: a diagnostic of `harvest_vs_hf_pipeline`.

`decode_bound` is their wall time over our one-token forwards alone: the ratio the harvest would reach if all our
prefills and everything of ours outside the forwards were free. SmolLM2-135M's shape at its recipe's batch of 16
with real stage lengths is the default: the key that sat nearest the goal of 2 (docs/measurements.md).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from bench.bench_decode import TASK
from bench.bench_peers import REAL_STAGES
from bench.harvest_vs_hf import Redo, Stages, decodable_only, fed_to_forward, hf_harvest, ours_harvest
from bench.models import embedded_tokenizer, smollm2_shape_model


@dataclass
class Split:
    wall: float = 0.0
    prefill_seconds: float = 0.0
    prefill_calls: int = 0
    decode_seconds: float = 0.0
    decode_calls: int = 0

    @property
    def outside(self) -> float:
        return self.wall - self.prefill_seconds - self.decode_seconds


@contextmanager
def timing_forwards(model: PreTrainedModel, into: Split) -> Iterator[None]:
    """Adds each forward's seconds to `into`, as a prefill or a one-token decode call (eager forwards only: a
    compiled step bypasses the module's hooks)."""
    began: list[tuple[float, int]] = []

    def start(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        began.append((time.perf_counter(), fed_to_forward(args, kwargs).shape[1]))

    def stop(module: torch.nn.Module, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        at, positions = began.pop()
        if positions == 1:
            into.decode_seconds += time.perf_counter() - at
            into.decode_calls += 1
        else:
            into.prefill_seconds += time.perf_counter() - at
            into.prefill_calls += 1

    handles = [model.register_forward_pre_hook(start, with_kwargs=True),
               model.register_forward_hook(stop, with_kwargs=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def split_harvest(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str], tokens: Stages,
    harvest: Callable[..., list[Redo]],
) -> Split:
    split = Split()
    with decodable_only(model, len(tokenizer)), torch.no_grad(), timing_forwards(model, split):
        began = time.perf_counter()
        harvest(model, tokenizer, prompts, tokens)
        split.wall = time.perf_counter() - began
    return split


def main(batch: int = 16, repeats: int = 2) -> None:
    torch.set_num_threads(2)
    tokenizer, model = embedded_tokenizer(), smollm2_shape_model()
    prompts = [e.prompt for e in TASK.examples("test", batch)]
    with decodable_only(model, len(tokenizer)), torch.no_grad():
        for harvest in (hf_harvest, ours_harvest):  # warm-up
            harvest(model, tokenizer, prompts[:2], Stages(2, 2))
    for _ in range(repeats):
        theirs = split_harvest(model, tokenizer, prompts, REAL_STAGES["smollm2"], hf_harvest)
        ours = split_harvest(model, tokenizer, prompts, REAL_STAGES["smollm2"], ours_harvest)
        for name, split in (("theirs", theirs), ("ours", ours)):
            print(f"{name}: {split.wall:.1f} s; prefills {split.prefill_seconds:.1f} s in {split.prefill_calls} calls,"
                  f" decode {split.decode_seconds:.1f} s in {split.decode_calls} calls, outside {split.outside:.1f} s")
        print(f"ratio {theirs.wall / ours.wall:.2f}; decode_bound {theirs.wall / ours.decode_seconds:.2f}", flush=True)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
