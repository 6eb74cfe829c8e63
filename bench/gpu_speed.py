"""gpu-check's static-cache and speed rows (bench/gpu_check.py runs them):

  static       the harvest (`redumix_generate`) with its turns and redo decoded on the static cache
               (generate/static_loop.py) against the dynamic loop, on the device in float32 (equal ids, stored top-k
               log-probs within STATIC_TOLERANCE); on CUDA also the CUDA-graph path against the eager static path, in
               float32 (the same) and bfloat16 (the share of equal ids)
  step         one decode step of the redo (the mixture of 2B rows), in ms: the dynamic loop, the static path eager,
               and the static path as a CUDA graph, side by side; a step's time is the difference of two loop lengths
               over their difference in tokens, so the layout and the capture drop out
  throughput   harvest examples/s of the user's `generate` loop, ours (dynamic), ours on the static path eager, and
               ours as CUDA graphs, side by side, with each one's peak memory
  compile      our harvest with `model.compile_decoding` off and on (the compile itself excluded)

The speed rows run on SmolLM2-135M (its weights after `make smollm2`, else its shape) and a Qwen2.5-1.5B-shaped model
with random weights, at each batch of the size (16 and 64); at smoke sizes on the embedded shape. The static path is
`HfEngine(static_cache=True)` (`model.static_cache`), with its CUDA graphs switched off for the eager figures.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from bench.bench_decode import FEEDBACK, TASK
from bench.gpu_rows import Row, Size
from bench.harvest_vs_hf import LAM, TOP_K, Redo, Stages, decodable_only, hf_harvest, ours_harvest
from bench.models import embedded_model, embedded_tokenizer, seeded_model, smollm2_shape_model
from redumix.generate.hf_engine import HfEngine
from redumix.generate.mixture import mixture_loop
from redumix.generate.model_io import ModelConfig, load_model
from redumix.generate.policy import SamplingPolicy
from redumix.generate.redumix import RedumixConfig, redumix_generate
from redumix.generate.state import prefill, use_compiled_decoding
from redumix.generate.static_loop import static_mixture_loop

# float32, static against dynamic, over a whole harvest: the redo's contexts come from three stages decoded each way,
# so a log-prob near −10 may move by 1e-6 relative; one loop from the same contexts holds 1e-5 (test_static_cache.py).
STATIC_TOLERANCE = 1e-4
Harvest = Callable[[PreTrainedModel, PreTrainedTokenizerBase, Sequence[str], Stages], list[Redo]]


def static_engine(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, graphs: bool) -> HfEngine:
    """`HfEngine` on the static path (`model.static_cache`), its steps as CUDA graphs or, with `graphs` off, eager
    on CUDA too: the two side by side."""
    engine = HfEngine(model, tokenizer, static_cache=True)
    engine.graphs = graphs
    return engine


def static_harvest(graphs: bool) -> Harvest:
    """`ours_harvest` with its turns and redo on the static path."""

    def harvest(model, tokenizer, prompts: Sequence[str], tokens: Stages) -> list[Redo]:
        config = RedumixConfig(lam=LAM, topk=TOP_K, reflection_max_tokens=tokens.reflection)
        policy = SamplingPolicy(max_new_tokens=tokens.answer)
        ids = [f"bench-{i}" for i in range(len(prompts))]
        results = redumix_generate(static_engine(model, tokenizer, graphs), prompts, ids, config, policy, 0,
                                   lambda i, attempt: FEEDBACK)
        return [Redo(r.x2_ids, r.redo_token_ids, r.topk_ids, r.topk_logprobs, r.tail_logprobs,
                     r.usage.generated_tokens) for r in results]

    return harvest


def on_cuda(device: str) -> bool:
    return device.startswith("cuda")


def sync(device: str) -> None:
    if on_cuda(device):
        torch.cuda.synchronize()


# --- static agreement -----------------------------------------------------------------------------------------------


def check_static(device: str, size: Size, model_of: Callable[[str], tuple], prompts: list[str],
                 compare: Callable) -> Iterator[Row]:
    """The static path against the dynamic loop, then (CUDA) the graph path against the eager one. `model_of(dtype)`
    gives (model, tokenizer) on the device; `compare(ours, reference)` gives (ids equal, result text, max |Δ|)."""
    stages = Stages(size.tokens * 4, size.tokens * 4)
    model, tokenizer = model_of("float32")
    with torch.no_grad():
        dynamic = ours_harvest(model, tokenizer, prompts, stages)
        static = static_harvest(False)(model, tokenizer, prompts, stages)
    equal, result, gap = compare(static, dynamic)
    yield Row("static cache vs dynamic loop (harvest)", "tiny-base", f"{device} float32", result,
              equal == len(prompts) and gap <= STATIC_TOLERANCE)
    if not on_cuda(device):
        yield Row("CUDA graph vs eager (static harvest)", "tiny-base", device, "skipped: CUDA graphs need CUDA", None)
        return
    for dtype in ("float32", "bfloat16"):
        model, tokenizer = model_of(dtype)
        with torch.no_grad():
            eager = static_harvest(False)(model, tokenizer, prompts, stages)
            graph = static_harvest(True)(model, tokenizer, prompts, stages)
        equal, result, gap = compare(graph, eager)
        yield Row("CUDA graph vs eager (static harvest)", "tiny-base", f"{device} {dtype}", result,
                  equal == len(prompts) and gap <= STATIC_TOLERANCE if dtype == "float32" else None)


# --- speed ----------------------------------------------------------------------------------------------------------


def speed_models(device: str, smoke: bool, smollm2: Path) -> Iterator[tuple[str, PreTrainedModel, object]]:
    """(label, model, tokenizer) of each speed row's shape, built one at a time on the device in the dtype it runs
    in: the Qwen2.5-1.5B shape first (the issue's goal), then SmolLM2-135M; the embedded shape at smoke sizes."""
    if smoke:
        yield smallest_model(device, smoke, smollm2)
        return
    with torch.device(device):  # random weights made on the device: seconds, not a minute on the host
        qwen = seeded_model("qwen2", 0, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                            num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                            max_position_embeddings=32768, rope_theta=1000000.0, pad_token_id=0, eos_token_id=1)
    yield "Qwen2.5-1.5B shape (random)", qwen.to(run_dtype(device)).eval(), embedded_tokenizer()
    del qwen
    if on_cuda(device):
        torch.cuda.empty_cache()
    yield smallest_model(device, smoke, smollm2)


def smallest_model(device: str, smoke: bool, smollm2: Path) -> tuple[str, PreTrainedModel, object]:
    """The embedded shape at smoke sizes; else SmolLM2-135M, its weights after `make smollm2`, else its shape."""
    tokenizer = embedded_tokenizer()
    if smoke:
        return "embedded shape (random)", embedded_model(tokenizer).to(device, run_dtype(device)), tokenizer
    if (smollm2 / "config.json").is_file():
        model, smol_tokenizer = load_model(smollm2, ModelConfig(device=device, dtype="bfloat16"))
        return "SmolLM2-135M-Instruct", model, smol_tokenizer
    with torch.device(device):
        model = smollm2_shape_model()
    return "SmolLM2-135M shape (random)", model.to(run_dtype(device)), tokenizer


def run_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if on_cuda(device) else torch.float32


def step_ms(model, tokenizer, batch: int, lengths: tuple[int, int], device: str) -> dict[str, float]:
    """ms per decode step of the redo's mixture (2·batch rows, x and a 4× longer x2, greedy, no stop), per path."""
    x = [tokenizer(e.prompt)["input_ids"] for e in TASK.examples("test", batch)]
    x2 = [ids * 4 for ids in x]
    seeds = torch.arange(batch)
    paths: dict[str, Callable] = {"dynamic": mixture_loop, "static eager": static_mixture_loop}
    if on_cuda(device):
        paths["static graph"] = partial(static_mixture_loop, graphs=True)
    found = {}
    with decodable_only(model, len(tokenizer)), torch.no_grad():
        x_state, x2_state = prefill(model, x, 0), prefill(model, x2, 0)
        for name, loop in paths.items():
            taken = []
            for tokens in (lengths[0], *lengths):  # the first, short, warms up
                policy = SamplingPolicy(max_new_tokens=tokens)
                sync(device)
                began = time.perf_counter()
                loop(model, x_state, x2_state, LAM, TOP_K, policy, seeds, [-1])
                sync(device)
                taken.append(time.perf_counter() - began)
            found[name] = 1000 * (taken[2] - taken[1]) / (lengths[1] - lengths[0])
    return found


def harvest_rate(model, tokenizer, harvest: Harvest, prompts: list[str], stages: Stages, batch: int,
                 device: str, repeats: int) -> tuple[float, float | None]:
    """(examples/s over `prompts` in batches of `batch`, median of `repeats` passes; peak memory in GiB or None)."""
    parts = [prompts[start : start + batch] for start in range(0, len(prompts), batch)]
    with decodable_only(model, len(tokenizer)), torch.no_grad():
        harvest(model, tokenizer, parts[0], Stages(2, 2))  # warm-up
        if on_cuda(device):
            torch.cuda.reset_peak_memory_stats()
        seconds = []
        for _ in range(repeats):
            sync(device)
            began = time.perf_counter()
            for part in parts:
                harvest(model, tokenizer, part, stages)
            sync(device)
            seconds.append(time.perf_counter() - began)
    memory = torch.cuda.max_memory_allocated() / 2**30 if on_cuda(device) else None
    return len(prompts) / statistics.median(seconds), memory


def check_speed(device: str, size: Size, smoke: bool, smollm2: Path, what: str) -> Iterator[Row]:
    """`what` is "step" (decode-step ms per path) or "throughput" (harvest examples/s per path), per shape and
    batch, every path side by side in the same process."""
    dtype = str(run_dtype(device)).removeprefix("torch.")
    harvests: dict[str, Harvest] = {"generate loop": hf_harvest, "ours": ours_harvest,
                                    "static eager": static_harvest(False)}
    if on_cuda(device):
        harvests["static graph"] = static_harvest(True)
    for label, model, tokenizer in speed_models(device, smoke, smollm2):
        for batch in size.batches:
            if what == "step":
                ms = step_ms(model, tokenizer, batch, size.step_tokens, device)
                result = ", ".join(f"{name} {value:.1f} ms" for name, value in ms.items())
                yield Row("decode step (redo, 2B rows)", label, f"{device} {dtype}, batch {batch}", result, None)
                continue
            prompts = [e.prompt for e in TASK.examples("test", min(2 * batch, size.examples))]
            rates = {name: harvest_rate(model, tokenizer, harvest, prompts, Stages(size.tokens, size.tokens), batch,
                                        device, size.repeats) for name, harvest in harvests.items()}
            base = rates["generate loop"][0]
            result = "; ".join(f"{name} {rate:.2f} ex/s (x{rate / base:.2f})"
                               + (f", {memory:.2f} GiB" if memory is not None else "")
                               for name, (rate, memory) in rates.items())
            yield Row("harvest throughput", label, f"{device} {dtype}, batch {batch}, {size.tokens} tokens a stage, "
                      f"{len(prompts)} examples", result, None)
        del model
        if on_cuda(device):
            torch.cuda.empty_cache()


def check_compile(device: str, size: Size, smoke: bool, smollm2: Path) -> Iterator[Row]:
    """Our harvest eager, then with its one-token steps compiled (the compile itself excluded), on the smallest
    shape, where a step is bound by its calls and compiling can pay."""
    label, model, tokenizer = smallest_model(device, smoke, smollm2)
    prompts = [e.prompt for e in TASK.examples("test", min(2 * size.batch, size.examples))]
    stages = Stages(size.tokens, size.tokens)
    eager, _ = harvest_rate(model, tokenizer, ours_harvest, prompts, stages, size.batch, device, size.repeats)
    use_compiled_decoding(model)
    with decodable_only(model, len(tokenizer)), torch.no_grad():  # the one-off compile
        for batch in (1, size.batch):
            ours_harvest(model, tokenizer, prompts[:batch], Stages(2, 2))
    compiled, _ = harvest_rate(model, tokenizer, ours_harvest, prompts, stages, size.batch, device, size.repeats)
    dtype = str(run_dtype(device)).removeprefix("torch.")
    yield Row("compile_decoding off -> on", label, f"{device} {dtype}, batch {size.batch}",
              f"eager {eager:.2f} ex/s, compiled {compiled:.2f} ex/s (x{compiled / eager:.2f})", None)
