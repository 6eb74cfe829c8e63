"""vLLM against the Hugging Face harvest (`make bench`, and `python -m bench.bench_vllm` alone). Both run ReDuMix's
four stages on the same examples, model and dtype (float32), timed side by side, interleaved, median kept:

  harvest_vllm_vs_hf_{model}_b{B}           harvest tokens/s (every generated token of every stage), vLLM's over
                                            `redumix_generate`'s, for model smollm2 (SmolLM2-135M-Instruct, `make
                                            smollm2`) and qwen_coder_0_5b (Qwen2.5-Coder-0.5B-Instruct, `make
                                            qwen-coder-0.5b`), real weights; the SmolLM2 recipe's arith task,
                                            verifier feedback, greedy, 32 tokens a stage. A CPU figure, not a GPU
                                            one; reported whatever it is.
  ..._hf_tokens_per_s, ..._vllm_tokens_per_s  the two rates behind the ratio
  ..._redo_ids_differ                       examples whose redo ids differ between the engines (float rounding
                                            can flip a near tie of a real model, and everything after it)
  ..._retried_pairs                         split pairs the engine decoded again over the whole run

Engine construction and the first (warm-up) call of each side are excluded. Without vLLM or a model's folder its
key says why it was skipped.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from redumix.data.tasks import make_task
from redumix.generate.hf_engine import HfEngine
from redumix.generate.model_io import load_model
from redumix.generate.redumix import redumix_generate, task_feedback
from redumix.generate.vllm_engine import VllmSettings, vllm_version
from redumix.pipeline.config import load_config

ROOT = Path(__file__).resolve().parents[1]
# key part -> folder: the two real models the issue names, smallest first
MODELS = {"smollm2": ROOT / "models" / "smollm2-135m-instruct",
          "qwen_coder_0_5b": ROOT / "models" / "qwen2.5-coder-0.5b-instruct"}
SETTINGS = ["sampling.max_new_tokens=32", "redumix.reflection_max_tokens=32", "sampling.temperature=0"]


def run(batch: int = 16, repeats: int = 2) -> dict[str, object]:
    results: dict[str, object] = {}
    for name, folder in MODELS.items():
        key = f"harvest_vllm_vs_hf_{name}_b{batch}"
        if vllm_version() is None:
            results[key] = "skipped: vLLM is not installed (`make vllm`)"
        elif not (folder / "config.json").is_file():
            results[key] = f"skipped: no {folder.relative_to(ROOT)} (`make smollm2`, `make qwen-coder-0.5b`)"
        else:
            results.update(compare(key, folder, batch, repeats))
    return results


def compare(key: str, folder: Path, batch: int, repeats: int) -> dict[str, object]:
    """The two harvests of one model, side by side."""
    from redumix.generate.vllm_engine import VllmEngine

    config = load_config(ROOT / "recipes" / "smollm2-135m-arith.yaml", [f"model.path={folder}", *SETTINGS])
    task = make_task(config.task, config.seed)
    examples = task.examples("train", batch)
    prompts, ids = [e.prompt for e in examples], [e.id for e in examples]
    feedback = task_feedback("verifier", task, examples, config.seed)
    hf_engine = HfEngine(*load_model(folder, config.model))
    engine = VllmEngine(folder, VllmSettings(kv_cache_gib=2), config.model.dtype, config.seed)

    def hf():
        return redumix_generate(hf_engine, prompts, ids, config.redumix, config.sampling, config.seed, feedback)

    def vllm():
        return redumix_generate(engine, prompts, ids, config.redumix, config.sampling, config.seed, feedback)

    hf(), vllm()  # warm-up: the first calls pay one-off set-up
    rates: dict[str, list[float]] = {"hf": [], "vllm": []}
    results = {}
    for _ in range(repeats):
        for name, fn in (("hf", hf), ("vllm", vllm)):
            began = time.perf_counter()
            results[name] = fn()
            seconds = time.perf_counter() - began
            rates[name].append(sum(r.usage.generated_tokens for r in results[name]) / seconds)
    hf_rate, vllm_rate = statistics.median(rates["hf"]), statistics.median(rates["vllm"])
    differ = sum(a.redo_token_ids != b.redo_token_ids for a, b in zip(results["hf"], results["vllm"], strict=True))
    return {
        key: round(vllm_rate / hf_rate, 3),
        f"{key}_hf_tokens_per_s": round(hf_rate, 1),
        f"{key}_vllm_tokens_per_s": round(vllm_rate, 1),
        f"{key}_redo_ids_differ": differ,
        f"{key}_retried_pairs": engine.retried_pairs,
    }


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(json.dumps(run(args.batch, args.repeats), indent=2))
