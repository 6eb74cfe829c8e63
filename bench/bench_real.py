"""`make bench`'s real-model keys: Qwen2.5-Coder-0.5B-Instruct's real weights (`make qwen-coder-0.5b`) on GSM8K
train problems, decoding as the real-model recipes run it (`model.dtype: auto`: bf16 on a CPU with bf16 in hardware)
against the loop a user writes with `model.generate` in float32, at batch 16, side by side in one run.

  real_{model}_harvest_bf16_vs_hf_float32_b16   harvest tokens/s (attempt, fixed feedback, reflection, mixture redo:
                                   `redumix_generate`) with bf16 weights, over the same four stages written with
                                   `model.generate` and its CFG redo in float32 (bench/harvest_vs_hf.py). Goal ≥ 4 on a
                                   CPU with bf16 in hardware.
  real_{model}_eval_bf16_vs_hf_float32_b16      greedy tokens/s, the eval's greedy decoder (`generate_batch`) with
                                   bf16 weights over `model.generate(do_sample=False)` in float32. Goal ≥ 4.
    ..._float32_vs_hf_float32      the same with our side in float32 too: what our loop buys without bf16
    ..._tokens_per_s_{ours_bf16,ours_float32,hf_float32}   each side's rate
  real_{model}_harvest_bf16_ids_match           share of redos whose ids equal ours in float32 (a near tie flips in
                                   bf16, and the redo follows its own attempt and reflection)
  real_{model}_harvest_bf16_logprob_gap_{median,max}   |Δ| in nats of the stored top-k log p_mix, bf16 against float32,
                                   over the tokens both redos share and the ids both top-k lists hold above −10
                                   (`bench/gpu_check.py`'s measure)
  real_{model}_eval_bf16_ids_match              share of greedy answers equal to ours in float32
  real_{model}_eval_float32_ids_match_hf        share of our float32 greedy answers equal to `generate`'s: 1 means the
                                   two sides decode the same tokens, so the eval keys time the same work
  matmul_bf16_vs_float32_{model}_decode_b16_1thread   the bound: one decode step's matrix products at the model's
                                   shapes (every linear layer and the output head, 16 rows, one thread), float32 time
                                   over bf16 time. A decode step of a model this size is its matrix products, so bf16
                                   buys a decode step at most about this, and ours in bf16 over `generate` in float32
                                   is at most about this times what our loop buys in float32.
  matmul_bf16_vs_float32_{model}_prefill_256rows_1thread   the same for a prefill's 256 positions (the layers only:
                                   the output head runs on the last position), the part of a step with long prompts.

Each side's tokens are what it emitted through its stop token (a row `generate` keeps padding after it stopped costs
that loop time, not tokens). Each side runs once, after a warm-up on one prompt: a float32 harvest of this
model at batch 16 takes minutes on 2 cores, so the key's noise is judged across `make bench` runs
(docs/benchmarks.md), not within one.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from bench.gpu_check import logprob_gaps
from bench.harvest_vs_hf import Redo, Stages, hf_harvest, ours_harvest, through_stop
from redumix.data.chat import prompt_ids
from redumix.data.prompts import attempt_messages
from redumix.data.tasks import make_task
from redumix.generate.model_io import ModelConfig, cpu_has_bf16, load_model, stop_token_ids
from redumix.generate.plain import generate_batch
from redumix.generate.policy import SamplingPolicy
from redumix.pipeline.config import load_config

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "qwen2.5-coder-0.5b-gsm8k.yaml"
KEY = "qwen_coder_0.5b"
BATCH = 16
# Caps well under a GSM8K answer's length, so nearly every row runs to them, and short enough that the three sides'
# harvests and evals take minutes, not an hour, on 2 cores.
HARVEST = Stages(answer=32, reflection=16)
EVAL_TOKENS = 48
WARM = Stages(2, 2)


def inputs() -> list[tuple[Path, str]]:
    """What `run` reads from outside the checkout, and how to get it (bench/run.py checks before any module runs)."""
    config = load_config(RECIPE)
    return [(ROOT / config.model.path / "config.json", "`make qwen-coder-0.5b` builds it"),
            (Path(config.task.gsm8k.path) / "train.jsonl", "GSM8K (MIT licence), which the recipes read from "
             f"{config.task.gsm8k.path}, relative to where the bench runs")]


def rate(count: Callable[[list], int], fn: Callable[..., list], *args: object) -> tuple[float, list]:
    """(tokens/s, products) of one call `fn(*args)`, its tokens counted from its products."""
    began = time.perf_counter()
    products = fn(*args)
    return count(products) / (time.perf_counter() - began), products


def ours_eval(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]],
              tokens: int) -> list[list[int]]:
    """The eval's greedy decoder: its ids per prompt, through the stop token."""
    gens = generate_batch(model, prompts, SamplingPolicy(max_new_tokens=tokens), [0] * len(prompts),
                          stop_token_ids(model, tokenizer), tokenizer.pad_token_id)
    return [g.token_ids for g in gens]


def hf_eval(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]],
            tokens: int) -> list[list[int]]:
    """Greedy decoding as a user writes it: `model.generate` on the left-padded batch, its ids through the stop."""
    stops = stop_token_ids(model, tokenizer)
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt", padding_side="left")
    out = model.generate(**batch, max_new_tokens=tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=stops)[:, batch["input_ids"].shape[1] :]
    return [ids[: through_stop(ids, stops)] for ids in out.tolist()]


def share_equal(a: Sequence[list[int]], b: Sequence[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def compare(bf16: PreTrainedModel, float32: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: list[str],
            harvest: Stages = HARVEST, eval_tokens: int = EVAL_TOKENS, key: str = KEY) -> dict[str, float]:
    """Every decoding key, one call per side, on the prompts `texts` (one batch)."""
    ids = [prompt_ids(tokenizer, attempt_messages(t)) for t in texts]
    sides = {"ours_bf16": (bf16, ours_harvest, ours_eval), "ours_float32": (float32, ours_harvest, ours_eval),
             "hf_float32": (float32, hf_harvest, hf_eval)}
    harvest_rate, eval_rate, redos, answers = {}, {}, {}, {}
    began = time.perf_counter()
    with torch.no_grad():
        # The first call of each side pays one-off costs; one prompt is enough to pay them (a batch of 16 would cost
        # the float32 sides their prefills again).
        for model, harvest_fn, eval_fn in sides.values():
            harvest_fn(model, tokenizer, texts[:1], WARM)
            eval_fn(model, tokenizer, ids[:1], WARM.answer)
        for side, (model, harvest_fn, eval_fn) in sides.items():
            harvest_rate[side], redos[side] = rate(lambda found: sum(r.generated for r in found), harvest_fn,
                                                   model, tokenizer, texts, harvest)
            eval_rate[side], answers[side] = rate(lambda found: sum(map(len, found)), eval_fn, model, tokenizer,
                                                  ids, eval_tokens)
            print(f"bench_real: {side}: harvest {harvest_rate[side]:.1f} tokens/s, eval {eval_rate[side]:.1f} "
                  f"tokens/s ({time.perf_counter() - began:.0f} s in)", flush=True)
    results: dict[str, float] = {}
    for stage, rates in (("harvest", harvest_rate), ("eval", eval_rate)):
        name = f"real_{key}_{stage}"
        results[f"{name}_bf16_vs_hf_float32_b{len(texts)}"] = round(rates["ours_bf16"] / rates["hf_float32"], 3)
        results[f"{name}_float32_vs_hf_float32_b{len(texts)}"] = round(rates["ours_float32"] / rates["hf_float32"], 3)
        for side, found in rates.items():
            results[f"{name}_tokens_per_s_{side}"] = round(found, 2)
    ours: list[Redo] = redos["ours_bf16"]
    results[f"real_{key}_harvest_bf16_ids_match"] = share_equal([r.token_ids for r in ours],
                                                                [r.token_ids for r in redos["ours_float32"]])
    gaps = logprob_gaps(ours, redos["ours_float32"])
    results[f"real_{key}_harvest_bf16_logprob_gap_median"] = round(statistics.median(gaps), 4) if gaps else math.nan
    results[f"real_{key}_harvest_bf16_logprob_gap_max"] = round(max(gaps), 4) if gaps else math.nan
    results[f"real_{key}_harvest_bf16_logprob_gap_entries"] = len(gaps)
    results[f"real_{key}_eval_bf16_ids_match"] = share_equal(answers["ours_bf16"], answers["ours_float32"])
    results[f"real_{key}_eval_float32_ids_match_hf"] = share_equal(answers["ours_float32"], answers["hf_float32"])
    return results


def step_shapes(config, head: bool = True) -> list[tuple[int, int]]:
    """(in, out) of every linear layer one forward runs each position through, the output head last if `head`."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    hidden, head_dim = config.hidden_size, config.hidden_size // config.num_attention_heads
    layer = [(hidden, heads * head_dim), (hidden, kv * head_dim), (hidden, kv * head_dim), (heads * head_dim, hidden),
             (hidden, config.intermediate_size), (hidden, config.intermediate_size),
             (config.intermediate_size, hidden)]
    return layer * config.num_hidden_layers + ([(hidden, config.vocab_size)] if head else [])


def matmul_bound(config, batch: int = BATCH, head: bool = True, min_seconds: float = 2.0) -> float:
    """float32 time over bf16 time of a forward's matrix products at `config`'s shapes, `batch` rows, one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = {}
        for dtype in (torch.float32, torch.bfloat16):
            weights = [torch.randn(out, into, dtype=dtype) for into, out in step_shapes(config, head)]
            inputs = {into: torch.randn(batch, into, dtype=dtype) for into, _ in step_shapes(config, head)}

            def step(weights=weights, inputs=inputs) -> None:
                for w in weights:
                    torch.nn.functional.linear(inputs[w.shape[1]], w)

            step()
            calls, began = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - began) < min_seconds or calls == 0:
                step()
                calls += 1
            seconds[dtype] = elapsed / calls
            del weights
        return seconds[torch.float32] / seconds[torch.bfloat16]
    finally:
        torch.set_num_threads(before)


def run(quick: bool = False) -> dict[str, float | str]:
    folder = ROOT / load_config(RECIPE).model.path
    if not (folder / "config.json").is_file():
        print(f"bench_real: skipped, no {folder.relative_to(ROOT)}: run `make qwen-coder-0.5b` (make bench does)")
        return {}
    torch.set_num_threads(2)
    if not cpu_has_bf16():
        print("bench_real: this CPU has no bf16 in hardware, so bf16 is emulated here and `model.dtype: auto` runs "
              "float32; the bf16 keys time the emulation")
    config = load_config(RECIPE)
    texts = [e.prompt for e in make_task(config.task, config.seed).examples("train", BATCH)]
    float32, tokenizer = load_model(folder, ModelConfig(dtype="float32", device="cpu"))
    bf16, _ = load_model(folder, ModelConfig(dtype="bfloat16", device="cpu"))
    sizes = (WARM, 4) if quick else (HARVEST, EVAL_TOKENS)
    results: dict[str, float | str] = {"real_model": f"{folder.name}, {config.task.name} train prompts, batch {BATCH}"}
    results |= compare(bf16, float32, tokenizer, texts, *sizes)
    results[f"matmul_bf16_vs_float32_{KEY}_decode_b{BATCH}_1thread"] = round(matmul_bound(float32.config), 3)
    results[f"matmul_bf16_vs_float32_{KEY}_prefill_256rows_1thread"] = round(
        matmul_bound(float32.config, 256, head=False), 3)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    results["real_cpu_bf16"] = f"bf16 in hardware: {cpu_has_bf16()}, AMX: {amx}"
    return results


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
