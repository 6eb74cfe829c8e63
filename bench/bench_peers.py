"""Our pipeline against what a user would write with the libraries it builds on (`make bench`). Every number is a
ratio of two timings taken side by side in one run, interleaved and repeated, with the median kept. The harvest keys'
pairs and the training keys' are dealt out over rounds through all of them (`round_robin`), the compiled keys' among
themselves.

  harvest_vs_hf_pipeline_{shape}_b{B}   harvest examples/s, `redumix_generate` over the same four stages written
                                        with transformers' `model.generate` and its CFG redo, 32 tokens a stage,
                                        at batch 1, 16 and the batch the shape's recipe harvests at (128 for the
                                        embedded default, 16 for SmolLM2-135M). Goal ≥ 2.
  harvest_vs_hf_pipeline_{shape}_real_b{B}  the same at the stage lengths of a real harvest of that shape
                                        (REAL_STAGES). Goal ≥ 2.
  harvest_vs_hf_pipeline_embedded[_real]_compiled_b{B}
                                        the same with our one-token steps compiled (`model.compile_decoding`);
                                        theirs stays as `generate` runs it. Goal ≥ 2.
  compile_decoding_seconds_embedded     the one-off compile those keys exclude (a batch of 1, then any batch)
  compile_decoding_graphs_embedded      graphs compiled by the end: 2 means no recompile while timing
    ..._calls_ratio                     their forward calls over ours: the floor where a forward costs its call
    ..._positions_ratio                 their row-positions forwarded over ours: the floor where it costs its tokens
    ..._rows_differ                     examples whose redo ids differ between the two pipelines as run
    ..._x2_differ                       examples whose x2 ids differ (their text round trip against our ids)
    ..._rows_differ_same_x2             examples whose redo ids differ once their CFG redo is given our x2 ids
  gkd_offline_vs_trl_live_teacher_{shape}_b{rows}
                                        step time of TRL's GKDTrainer with a live two-context teacher over our
                                        offline sparse trainer's step. Goal ≥ 1.5.

The comparisons are in harvest_vs_hf.py and gkd_vs_trl.py; this module runs them. The shapes are bench/models.py's,
seed-built: `embedded` (hidden 96, 4 layers, vocabulary 768) and `smollm2` (SmolLM2-135M's architecture, random
weights). The smollm2 runs are cut to what fits in a `make bench`: fewer repeats, and 2 training rows instead of 16
(a 135M step at 16 × 160 tokens would take most of the bench's time; docs/measurements.md has the timings).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from bench.bench_decode import ROUNDS, TASK, Pairs, round_robin
from bench.gkd_vs_trl import gkd_offline_vs_trl_live_teacher
from bench.harvest_vs_hf import HarvestComparison, Stages, harvest_pairs, ours_harvest
from bench.models import embedded_model, embedded_tokenizer, smollm2_shape_model
from redumix.generate.state import use_compiled_decoding
from redumix.pipeline.config import load_config

Run = tuple[int, int, int]  # (batch, examples, repeats)


def with_recipe_batch(runs: tuple[Run, ...], batch: int, repeats: int) -> tuple[Run, ...]:
    """`runs` and one batch of the recipe's size, unless a run already has that batch (its key would repeat)."""
    return runs if any(b == batch for b, _, _ in runs) else (*runs, (batch, batch, repeats))


RECIPES = Path(__file__).resolve().parents[1] / "recipes"
# The batch each shape's recipe harvests at: recipes/tiny.yaml's for the embedded default (128), and SmolLM2-135M's
# recipe's (16), which the batch-16 keys already cover.
RECIPE_BATCH = {"embedded": load_config(RECIPES / "tiny.yaml").harvest.batch_size,
                "smollm2": load_config(RECIPES / "smollm2-135m-arith.yaml").harvest.batch_size}
# The runs per shape, the recipe batch last: a smollm2 example costs far more than an embedded one, so it gets fewer
# of both. The embedded batch-1 pairs are short and spread widely within a process and between processes, so 9 of
# them; SmolLM2's batch-16 pairs take minutes and a single pair moved a lot between runs, so 2, in two rounds
# (docs/measurements.md, "Bench noise").
HARVEST_RUNS = {"embedded": with_recipe_batch(((1, 8, 9), (16, 16, 5)), RECIPE_BATCH["embedded"], 5),
                "smollm2": with_recipe_batch(((1, 1, 1),), RECIPE_BATCH["smollm2"], 2)}
# The `_real` keys' stage lengths: the median stages of real harvests, whose caps they become. The embedded default's
# (runs/evidence, 2,048 rows: attempt 24, reflection 79, redo 24 tokens) and SmolLM2-135M-Instruct's on its recipe
# (96 rows: attempt 92, reflection 96, redo 96; caps 96). Its x stays the bench prompt's (≈20 tokens, against 85
# under SmolLM2's own template), which spares their re-encoding.
REAL_STAGES = {"embedded": Stages(24, 80), "smollm2": Stages(96, 96)}
TRAIN_RUNS = {"embedded": (16, 3), "smollm2": (2, 2)}  # (rows, repeats)
FULL = {"tokens": 32, "x": 40, "x2": 280, "y": 120}
QUICK = {"tokens": 3, "x": 8, "x2": 24, "y": 8}  # only checks that every key comes out: the ratios mean nothing


def record_harvest(results: dict[str, float | int], key: str, found: HarvestComparison) -> None:
    results[key] = round(found.ratio, 3)
    results[f"{key}_calls_ratio"] = round(found.calls_ratio, 3)
    results[f"{key}_positions_ratio"] = round(found.positions_ratio, 3)
    results[f"{key}_rows_differ"] = found.rows_differ
    results[f"{key}_x2_differ"] = found.x2_differ
    results[f"{key}_rows_differ_same_x2"] = found.rows_differ_same_x2
    print(f"bench_peers: {key} {found}", flush=True)


def compile_decoding(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> float:
    """Seconds to turn on `use_compiled_decoding` and compile its two graphs: one harvest of a single example decodes
    a batch of 1 (attempt, reflection) and of 2 (the redo's two contexts), which is dynamic for any larger batch."""
    began = time.perf_counter()
    use_compiled_decoding(model)
    with torch.no_grad():
        ours_harvest(model, tokenizer, [e.prompt for e in TASK.examples("test", 1)], Stages(2, 2))
    return time.perf_counter() - began


def run(quick: bool = False) -> dict[str, float | int]:
    torch.set_num_threads(2)
    size = QUICK if quick else FULL
    tokenizer = embedded_tokenizer()
    results: dict[str, float | int] = {}
    fixed = Stages(size["tokens"], size["tokens"])
    rounds = 1 if quick else ROUNDS
    models = {"embedded": embedded_model(tokenizer), "smollm2": smollm2_shape_model()}
    harvests = {}
    for shape, model in models.items():
        real = fixed if quick else REAL_STAGES[shape]
        for batch, n, repeats in HARVEST_RUNS[shape]:
            for name, stages in ((shape, fixed), (f"{shape}_real", real)):
                harvests[f"harvest_vs_hf_pipeline_{name}_b{batch}"] = harvest_pairs(model, tokenizer, batch, n, stages,
                                                                                    repeats)
    trainings = {}
    for shape, model in models.items():
        rows, repeats = TRAIN_RUNS[shape]
        trainings[f"gkd_offline_vs_trl_live_teacher_{shape}_b{rows}"] = gkd_offline_vs_trl_live_teacher(
            model, tokenizer, rows, size["x"], size["x2"], size["y"], 1 if quick else repeats)
    ratios = time_harvests(results, harvests, rounds, trainings)
    for key in trainings:
        results[key] = round(ratios[key], 3)
        print(f"bench_peers: {key} {results[key]}", flush=True)
    del models, harvests, trainings
    # The compiled harvest last, on a fresh model, so no other key is timed in a process that has run compiled
    # kernels. Embedded shape only: at SmolLM2's a compile takes minutes and the compiled CPU step was slower than the
    # eager one (docs/measurements.md, "Compiled decoding").
    model = embedded_model(tokenizer)
    real_embedded = fixed if quick else REAL_STAGES["embedded"]
    results["compile_decoding_seconds_embedded"] = round(compile_decoding(model, tokenizer), 1)
    harvests = {f"harvest_vs_hf_pipeline_{name}_compiled_b{batch}": harvest_pairs(model, tokenizer, batch, n, stages,
                                                                                  repeats)
                for batch, n, repeats in HARVEST_RUNS["embedded"]
                for name, stages in (("embedded", fixed), ("embedded_real", real_embedded))}
    time_harvests(results, harvests, rounds)
    results["compile_decoding_graphs_embedded"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return results


def time_harvests(
    results: dict[str, float | int], harvests: dict[str, tuple[Pairs, Callable[[float], HarvestComparison]]],
    rounds: int, others: dict[str, Pairs] | None = None,
) -> dict[str, float]:
    """Records the harvest keys' comparisons; returns every key's ratio, `others`' dealt out in the same rounds."""
    ratios = round_robin({key: pairs for key, (pairs, _) in harvests.items()} | (others or {}), rounds,
                         label="bench_peers")
    for key, (_, compare) in harvests.items():
        record_harvest(results, key, compare(ratios[key]))
    return ratios


if __name__ == "__main__":
    print(run())
