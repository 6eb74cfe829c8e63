"""`make gpu-check`: the GPU path, checked where it runs, printed as one table.

On a CUDA machine every check runs on `cuda`, in bfloat16 where the recipes run and in float32 where ids must match,
against the same code on the CPU in float32:

  decoders     each eval decoder on the shipped tiny base: its ids on the device against the CPU's. In float32 they
               must be equal; in bfloat16 a near tie may flip, so the share that matches is reported
  harvest      the harvest's call (`redumix_generate`): redo ids, and the stored p_mix top-k log-probs on the tokens
               both sides share, which must agree within bfloat16's tolerance (median |Δ| <= BF16_TOLERANCE nats);
               and the ReDuMix redo against transformers' CFG (`guidance_scale=λ, negative_prompt_ids=x2`) on the
               device, given our x2: equal ids in float32
  static       the harvest on the static-cache path (generate/static_loop.py) against the dynamic loop, and on CUDA
               the CUDA-graph path against the eager one (bench/gpu_speed.py, as are the next three)
  lora         the pipeline's own harvest and train stages on the device (LoRA, 2 steps): finite losses
  step         one decode step of the redo in ms: the dynamic loop, the static path eager and as a CUDA graph
  throughput   harvest examples/s and peak memory of each of those against the `generate` loop a user writes, at
               batch 16 and 64, on a Qwen2.5-1.5B-shaped model with random weights and SmolLM2-135M (its weights
               after `make smollm2`, else its shape)
  compile      our harvest with `model.compile_decoding` off and on, on SmolLM2-135M
  vllm         where vLLM imports (`make vllm`; the CUDA `vllm` package on a GPU): the engine's ReDuMix redo, as
               paired requests, against redumix's own Hugging Face redo on the same device in float32 (equal ids,
               stored top-k log-probs within VLLM_TOLERANCE), and a sampled redo alone against the same in a batch.
               Elsewhere the row says it was skipped and why

Each row is printed and written to `--json` as soon as it is done. `--only static,step` runs some checks (the names
above); `--budget-s S` starts no row after S seconds and says which checks it skipped, so a lease that ends keeps
every finished row (bench/gpu_rows.py).

Without CUDA it runs a smoke version on the CPU (`--smoke`, the default there): bfloat16 against float32 on the CPU,
the embedded shape for the speed rows, a few tokens a stage. The same code paths run, so CI finds a break
before a GPU session does; the smoke's timings are not measurements of anything.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bench.gpu_rows import FULL, SMOKE, Check, Row, Size, pick, run_checks, table
from bench.gpu_speed import check_compile, check_speed, check_static
from bench.harvest_vs_hf import Redo, Stages, hf_redo, ours_harvest
from bench.models import embedded_tokenizer, seeded_model, smollm2_shape_model
from redumix.common.files import read_json
from redumix.data.tasks import make_task
from redumix.generate.hf_engine import HfEngine
from redumix.generate.model_io import ModelConfig, load_model
from redumix.pipeline.config import load_config
from redumix.pipeline.decoders import make_decoder

ROOT = Path(__file__).resolve().parents[1]
TINY_BASE = ROOT / "models" / "tiny-base"
SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"
DECODERS = ["greedy", "redumix-oracle", "redumix-self", "moi", "pdr", "sr", "reflective"]
# bfloat16 keeps 8 bits of mantissa (a relative step of 2^-8); a log-prob near −1 that has been through a few layers
# of it moves by a few hundredths of a nat. The median over shared tokens must stay within this.
BF16_TOLERANCE = 0.05
# The engine's stored top-k log-probs against the Hugging Face redo's, both float32 (the CPU tests hold 1e-4).
VLLM_TOLERANCE = 1e-4


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def compare_ids(ours: list[list[int]], reference: list[list[int]]) -> tuple[int, str]:
    """How many rows are equal, and where the others first differ."""
    equal = sum(a == b for a, b in zip(ours, reference, strict=True))
    differ = [first_difference(a, b) for a, b in zip(ours, reference, strict=True) if a != b]
    where = f"; the others first differ at token {statistics.median(differ):g} (median)" if differ else ""
    return equal, f"ids equal on {equal}/{len(reference)}{where}"


def logprob_gaps(ours: list[Redo], reference: list[Redo], floor: float = -10.0) -> list[float]:
    """|Δ| of p_mix's log-prob for every token in both top-k lists above `floor` (in the reference), at each redo
    position both sides reached alike (the shared prefix): the whole stored target, not only its near-certain top-1."""
    gaps = []
    for a, b in zip(ours, reference, strict=True):
        for t in range(first_difference(a.token_ids, b.token_ids)):
            theirs = dict(zip(b.topk_ids[t], b.topk_logprobs[t], strict=True))
            gaps += [abs(lp - theirs[i]) for i, lp in zip(a.topk_ids[t], a.topk_logprobs[t], strict=True)
                     if i in theirs and theirs[i] > floor]
    return gaps


def decoder_ids(model, tokenizer, config, task, examples, name: str) -> list[list[int]]:
    with torch.no_grad():
        decoded = make_decoder(config, name, {})(HfEngine(model, tokenizer), examples, task)
    return [d.token_ids for d in decoded]


def check_decoders(device: str, size: Size) -> Iterator[Row]:
    config = load_config(ROOT / "recipes" / "tiny.yaml", [f"sampling.max_new_tokens={4 * size.tokens}"])
    task = make_task(config.task, config.seed)
    examples = task.examples("test", size.examples)
    reference_model, tokenizer = load_model(TINY_BASE, ModelConfig(device="cpu", dtype="float32"))
    reference = {name: decoder_ids(reference_model, tokenizer, config, task, examples, name) for name in DECODERS}
    for dtype in ("float32", "bfloat16"):
        model, _ = load_model(TINY_BASE, ModelConfig(device=device, dtype=dtype))
        for name in DECODERS:
            equal, result = compare_ids(decoder_ids(model, tokenizer, config, task, examples, name), reference[name])
            yield Row(f"decoder {name}", "tiny-base", f"{device} {dtype} vs cpu float32", result,
                      equal == len(examples) if dtype == "float32" else None)


def tiny_prompts(size: Size) -> list[str]:
    return [e.prompt for e in make_task(load_config(ROOT / "recipes" / "tiny.yaml").task, 0).examples(
        "test", size.examples)]


def check_harvest_and_cfg(device: str, size: Size) -> Iterator[Row]:
    tokenizer, prompts = embedded_tokenizer(), tiny_prompts(size)
    stages = Stages(size.tokens * 4, size.tokens * 4)
    reference_model, _ = load_model(TINY_BASE, ModelConfig(device="cpu", dtype="float32"))
    with torch.no_grad():
        reference = ours_harvest(reference_model, tokenizer, prompts, stages)
    for dtype in ("float32", "bfloat16"):
        model, _ = load_model(TINY_BASE, ModelConfig(device=device, dtype=dtype))
        with torch.no_grad():
            ours = ours_harvest(model, tokenizer, prompts, stages)
            theirs = hf_redo(model, tokenizer, prompts, [r.x2 for r in ours], stages.answer)
        equal, result = compare_ids([r.token_ids for r in ours], [r.token_ids for r in reference])
        gaps = logprob_gaps(ours, reference)
        median_gap = statistics.median(gaps) if gaps else math.nan
        result += (f"; p_mix top-k log-prob |Δ| median {median_gap:.4f}, max {max(gaps, default=math.nan):.4f} nats "
                   f"over {len(gaps)} entries")
        ok = equal == len(prompts) if dtype == "float32" else median_gap <= BF16_TOLERANCE
        yield Row("harvest (redumix_generate)", "tiny-base", f"{device} {dtype} vs cpu float32", result, ok)
        cfg_equal, cfg_result = compare_ids([r.token_ids for r in theirs], [r.token_ids for r in ours])
        yield Row("ReDuMix redo vs transformers CFG", "tiny-base", f"{device} {dtype}, our x2 given",
                  cfg_result, cfg_equal == len(prompts) if dtype == "float32" else None)


def compare_redos(ours: list[Redo], reference: list[Redo]) -> tuple[int, str, float]:
    """(rows with equal ids, the comparison in words, the largest |Δ| of a stored top-k log-prob both share)."""
    equal, result = compare_ids([r.token_ids for r in ours], [r.token_ids for r in reference])
    gaps = logprob_gaps(ours, reference)
    gap = max(gaps, default=0.0)
    return equal, f"{result}; stored top-k log-probs |Δ| max {gap:.1e} nats over {len(gaps)} entries", gap


def tiny_base(device: str, dtype: str):
    return load_model(TINY_BASE, ModelConfig(device=device, dtype=dtype))[0], embedded_tokenizer()


def check_lora_step(device: str, size: Size) -> list[Row]:
    on_gpu = device.startswith("cuda")
    try:  # TRL and datasets, which a lent GPU machine has only where their wheels were carried (gpu_session.sh)
        from redumix.pipeline.harvest import run_harvest
        from redumix.pipeline.run import RunDir
        from redumix.pipeline.train import run_train
    except ImportError as exc:
        return [Row("LoRA train step (harvest + train stages)", "tiny-base", device, f"skipped: {exc}", None)]
    # 32 rows leave the train stage a held-out slice to score its KL on.
    overrides = [f"model.path={TINY_BASE}", f"model.device={device}", "harvest.n=32",
                 f"harvest.batch_size={size.batch}", f"harvest.shard_rows={size.batch}", "train.adapter=lora",
                 "train.max_steps=2", "train.batch_size=2", "train.skill_rows=false", "train.replay=0",
                 f"train.bf16={str(on_gpu).lower()}", "train.save_steps=2"]
    config = load_config(ROOT / "recipes" / "tiny.yaml", overrides)
    with tempfile.TemporaryDirectory() as folder:
        run = RunDir(Path(folder))
        run_harvest(config, run)
        run_train(config, run)
        metrics = read_json(run.train / "metrics.json")
    finite = all(metrics[k] is not None and math.isfinite(metrics[k])
                 for k in ("final_loss", "heldout_kl_base", "heldout_kl_merged"))
    finite = finite and metrics["heldout_tokens"] > 0
    figure = {k: "null" if metrics[k] is None else f"{metrics[k]:.4f}"  # null: undefined (metrics.json says why)
              for k in ("final_loss", "heldout_kl_base", "heldout_kl_merged")}
    result = (f"{metrics['steps']} steps, {metrics['seconds_per_step']:.3f} s/step, loss {figure['final_loss']}, "
              f"held-out KL {figure['heldout_kl_base']} -> {figure['heldout_kl_merged']}")
    setting = f"{device}, bf16 autocast {'on' if on_gpu else 'off'}"
    return [Row("LoRA train step (harvest + train stages)", "tiny-base", setting, result,
                finite and metrics["steps"] == 2)]


def check_vllm_engine(device: str, size: Size) -> list[Row]:
    """The vLLM engine (engine=vllm) against redumix's Hugging Face redo on the device, float32: a random
    head_dim-64 Llama at smoke sizes, SmolLM2-135M (its weights when `make smollm2` has run) on a GPU."""
    check = "vLLM engine: paired ReDuMix redo vs HF redo"
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        return [Row(check, "-", device, f"skipped: vLLM does not import here ({exc}); `make vllm` adds the CPU "
                    "engine, the CUDA `vllm` package the GPU one (docs/multiprocess-and-gpus.md)", None)]
    from redumix.generate.mixture import mixture_loop
    from redumix.generate.policy import SamplingPolicy
    from redumix.generate.state import prefill
    from redumix.generate.vllm_engine import VllmEngine, VllmSettings

    with tempfile.TemporaryDirectory() as folder:
        label, path = _vllm_model(Path(folder), size)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()  # vLLM sizes its cache from the memory free when it starts
        engine = VllmEngine(path, VllmSettings(kv_cache_gib=1, gpu_memory_utilization=0.3), "float32", 0, device)
        g = torch.Generator().manual_seed(0)
        x = [torch.randint(2, 512, (8 + 4 * i,), generator=g).tolist() for i in range(size.examples)]
        x2 = [p + torch.randint(2, 512, (40,), generator=g).tolist() for p in x]
        seeds, stop, tokens = list(range(size.examples)), [int(model.config.eos_token_id)], 4 * size.tokens
        greedy, sampled = SamplingPolicy(max_new_tokens=tokens), SamplingPolicy(temperature=1.0, max_new_tokens=tokens)
        ours = engine.mix(x, x2, seeds, 0.5, 5, greedy, stop, tokens)
        with torch.no_grad():
            theirs = mixture_loop(model, prefill(model, x, 0), prefill(model, x2, 0), 0.5, 5, greedy,
                                  torch.tensor(seeds), stop, tokens)
        crowd = engine.mix(x[::-1], x2[::-1], seeds[::-1], 0.5, 5, sampled, stop, tokens)[-1].generation.token_ids
        alone = engine.mix(x[:1], x2[:1], seeds[:1], 0.5, 5, sampled, stop, tokens)[0].generation.token_ids
    equal, result = compare_ids([r.generation.token_ids for r in ours], [t[0].token_ids for t in theirs])
    gap = max((abs(a - b) for r, t in zip(ours, theirs, strict=True) if r.topk_ids == t[1]
               for row_a, row_b in zip(r.topk_logprobs, t[2], strict=True) for a, b in zip(row_a, row_b, strict=True)),
              default=math.nan)
    result += (f"; stored top-k log-probs differ by at most {gap:.2e} nats; a sampled redo alone equals it in a "
               f"batch: {alone == crowd}")
    ok = equal == len(x) and gap <= VLLM_TOLERANCE and alone == crowd
    return [Row(check, label, f"{device} float32, vLLM {vllm.__version__}, V1 model runner", result, ok)]


def _vllm_model(folder: Path, size: Size) -> tuple[str, Path]:
    """A model vLLM takes (head_dim 64): SmolLM2 on a GPU, as a real folder or its shape; a tiny Llama at smoke."""
    if size is FULL and (SMOLLM2 / "config.json").is_file():
        return "SmolLM2-135M-Instruct", SMOLLM2
    if size is FULL:
        smollm2_shape_model().save_pretrained(folder)
        return "SmolLM2-135M shape (random)", folder
    seeded_model("llama", 0, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                 initializer_range=0.2, eos_token_id=1, pad_token_id=0, bos_token_id=None).save_pretrained(folder)
    return "Llama, head_dim 64 (random)", folder


def checks(device: str, size: Size, smoke: bool) -> dict[str, Check]:
    """Every check by its `--only` name, in the order they run: what a lease has not yet measured first (the static
    path's agreement, then its speed), the checks that earlier leases passed after, the costliest last."""
    return {
        "static": lambda: check_static(device, size, partial(tiny_base, device), tiny_prompts(size), compare_redos),
        "step": partial(check_speed, device, size, smoke, SMOLLM2, "step"),
        "throughput": partial(check_speed, device, size, smoke, SMOLLM2, "throughput"),
        "harvest": partial(check_harvest_and_cfg, device, size),
        "decoders": partial(check_decoders, device, size),
        "lora": partial(check_lora_step, device, size),
        "vllm": partial(check_vllm_engine, device, size),
        "compile": partial(check_compile, device, size, smoke, SMOLLM2),
    }


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action=argparse.BooleanOptionalAction, default=None,
                        help="the short CPU version (the default without CUDA)")
    parser.add_argument("--json", type=Path, help="also write the rows here, each as soon as it is done")
    parser.add_argument("--only", help="comma-separated checks to run: " + ", ".join(checks("cpu", SMOKE, True)))
    parser.add_argument("--budget-s", type=float, help="start no row after this many seconds (the rest are skipped)")
    args = parser.parse_args(argv)
    smoke = args.smoke if args.smoke is not None else not args.device.startswith("cuda")
    size = SMOKE if smoke else FULL
    chosen = pick(checks(args.device, size, smoke), args.only)
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"gpu-check on {args.device} ({where}), {'smoke' if smoke else 'full'} sizes: {', '.join(chosen)}"
          + (f", budget {args.budget_s:g} s" if args.budget_s is not None else ""), flush=True)
    rows = run_checks(chosen, args.budget_s, args.json)
    print(table(rows))
    failed = [r.check for r in rows if r.ok is False]
    if failed:
        raise SystemExit(f"gpu-check: {len(failed)} checks failed: {', '.join(failed)}")
    return rows


if __name__ == "__main__":
    main()
