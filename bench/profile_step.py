"""Where a decode step's milliseconds go: redumix's loop (generate/loop.py, state.py, mixture.py) at the embedded
shape, its parts timed by wrapping them, for the redo's mixture step (2B rows: x, and an x2 four times as long) and a
plain turn's step (B rows). `python -m bench.profile_step --batch 128 --threads 1`; docs/benchmarks.md has a run.

Each part's wall time is summed over the loop's steps, one timer per call, so the parts nest: `model` holds the
model's whole forward, its layers, mask, rotary embedding and head below it; `state.forward` holds `model` and the
bookkeeping around it (positions, the mask, the cache's growth). The timers cost a few microseconds a call, the same
before and after a change, so compare runs of this script, side by side, not with the bench's keys.
"""

from __future__ import annotations

import argparse
import collections
import functools
import time
from collections.abc import Callable

import torch
import transformers.masking_utils
from transformers.models.llama import modeling_llama

from bench.bench_decode import TASK
from bench.models import embedded_model, embedded_tokenizer
from redumix.data.chat import prompt_ids
from redumix.data.prompts import attempt_messages
from redumix.generate import loop, mixture, plain, state
from redumix.generate.policy import SamplingPolicy


class Parts:
    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def timed(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - began
                self.calls[name] += 1

        return inner


def instrument(model, parts: Parts) -> None:
    """Wrap the parts of a step where they are looked up: the model's modules, and the names loop.py, mixture.py and
    state.py call."""
    model.forward = parts.timed("model", model.forward)
    for layer in model.model.layers:
        layer.forward = parts.timed("  layers", layer.forward)
    for name, module in (("  rotary", model.model.rotary_emb), ("  lm_head", model.lm_head),
                         ("  norm", model.model.norm), ("  embed", model.model.embed_tokens)):
        module.forward = parts.timed(name, module.forward)
    mask = transformers.masking_utils.create_causal_mask
    modeling_llama.create_causal_mask = parts.timed("  mask (transformers)", mask)
    loop.forward = parts.timed("state.forward", state.forward)
    state.GrowingLayer.update = parts.timed("  cache update", state.GrowingLayer.update)
    mixture.mixture_topk = parts.timed("mixture_topk", mixture.mixture_topk)
    for module in (loop, mixture):
        module.merge = parts.timed("merge", state.merge)
    loop.select = parts.timed("select (compaction)", state.select)
    plain.decode_loop = mixture.decode_loop = parts.timed("decode_loop", loop.decode_loop)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=32, help="steps a loop")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer = embedded_tokenizer()
    model = embedded_model(tokenizer)
    x = [prompt_ids(tokenizer, attempt_messages(e.prompt)) for e in TASK.examples("test", args.batch)]
    seeds, policy, never = torch.arange(args.batch), SamplingPolicy(max_new_tokens=args.tokens), [-1]
    with torch.no_grad():
        x_state, x2_state = state.prefill(model, x, 0), state.prefill(model, [ids * 4 for ids in x], 0)
    loops = {
        f"mixture step, {2 * args.batch} rows": lambda: mixture.mixture_loop(model, x_state, x2_state, 0.5, 32, policy,
                                                                              seeds, never),
        f"plain step, {args.batch} rows": lambda: plain.sample_loop(model, state.clone(x2_state), policy, seeds, never,
                                                                    keep_state=True),
    }
    for run in loops.values():  # warm-up
        run()
    parts = Parts()
    instrument(model, parts)
    for label, run in loops.items():
        parts.seconds.clear()
        parts.calls.clear()
        began = time.perf_counter()
        for _ in range(args.repeats):
            run()
        steps = args.repeats * args.tokens
        total = time.perf_counter() - began
        print(f"{label} (embedded shape, {torch.get_num_threads()} thread(s)): {1000 * total / steps:.2f} ms a step")
        for name, seconds in sorted(parts.seconds.items(), key=lambda item: -item[1]):
            print(f"  {name:24s} {1000 * seconds / steps:8.3f} ms  {100 * seconds / total:5.1f}%  "
                  f"{parts.calls[name] / steps:.2f} calls a step")


if __name__ == "__main__":
    main()
