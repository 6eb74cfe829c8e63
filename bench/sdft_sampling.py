"""How much of an SDFT step is TRL's sampling (`python -m bench.sdft_sampling`): the same SDFT run with the
student's samples drawn by `model.generate` (`train.sdft_sampler=generate`, the default) and by vLLM in the same
process (`train.sdft_sampler=vllm`: TRL's `use_vllm`, colocate mode), each side in its own process, alternating,
`--rounds` times. Not in `make bench`: it needs `make vllm` and `make qwen-coder-0.5b`, and takes about 8 minutes a
round on 2 cores.

The run is `recipes/qwen2.5-coder-0.5b-mbpp-reference.yaml`'s SDFT arm (train/sdft.py, the same trainer, settings
and seed) for `--steps` steps, on MBPP train problems whose privileged turns are a stand-in attempt and the problem's
reference solution as feedback: the rung's x2 without its harvest. The first step, which includes vLLM's start, is
left out of each side's total. With one seed both sides sample the same problems; their samples differ (two
samplers), so each step's mean sample length is printed beside its time.

On a CPU the vLLM side's weight sync goes through vLLM's `reload_weights` (train/sdft.py). After training, the vLLM
side checks it: vLLM's log-probs of the student's greedy reply against the student's and the starting model's
(`sync_check_*`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "qwen2.5-coder-0.5b-mbpp-reference.yaml"
MODEL = ROOT / "models" / "qwen2.5-coder-0.5b-instruct"


def one_side(side: str, steps: int, out: Path) -> dict[str, Any]:
    """Train `steps` SDFT steps with `side`'s sampler; the step times, sample lengths and (vLLM) the sync check."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from datasets import Dataset
    from transformers import TrainerCallback

    import redumix.train.sdft as sdft
    from redumix.data.tasks import make_task
    from redumix.generate.model_io import load_tokenizer, load_weights
    from redumix.pipeline.config import load_config
    from redumix.pipeline.train import trainer_seed
    from redumix.train.trainer import TrainerSetup

    sampler = "vllm" if side == "vllm" else "generate"
    config = load_config(RECIPE, ["train.method=sdft", "train.sdft_teacher=base", f"train.sdft_sampler={sampler}",
                                  f"train.max_steps={steps}",
                                  "train.save_steps=100000", "train.logging_steps=1", f"model.path={MODEL}"])
    task = make_task(config.task, config.seed)
    problems = task.examples("train", 64)
    references = task.solutions("train", 64)
    rows = Dataset.from_list([{"id": problem.id, "prompt": problem.prompt, "original": "def f():\n    pass",
                               "feedback": "A reference solution:\n" + references[problem.id],
                               "reflection": "I will write the function as the reference does."}
                              for problem in problems])

    class StepEnds(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.ends.append(time.perf_counter())

    tokenizer = load_tokenizer(MODEL, False)
    model = load_weights(MODEL, config.model)
    step_ends = StepEnds()
    examples = sdft.sdft_examples(rows, tokenizer, config.train.max_length, config.train.onpolicy_max_new_tokens)
    assert len(examples) == len(rows), "every problem's x2 fits train.max_length"
    setup = TrainerSetup(str(out / side), trainer_seed(config), True, 1, (step_ends,))
    trainer = sdft.build_sdft_trainer(model, tokenizer, examples, config.train, setup)
    began = time.perf_counter()
    trainer.train()
    times = [b - a for a, b in zip([began, *step_ends.ends], step_ends.ends, strict=False)]
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    result: dict[str, Any] = {"side": side, "step_seconds": [round(t, 1) for t in times],
                              "mean_sample_tokens": [round(n, 1) for n in lengths],
                              "total_after_first": round(sum(times[1:]), 1)}
    if side == "vllm":
        to_student, to_start = sync_gaps(trainer, tokenizer, examples[0]["prompt"], 48)
        result.update(sync_check_mean_abs_logprob_gap_to_student=round(to_student, 4),
                      sync_check_mean_abs_logprob_gap_to_start=round(to_start, 4))
    return result


def sync_gaps(trainer: Any, tokenizer: Any, prompt: list[dict[str, str]], new_tokens: int) -> tuple[float, float]:
    """After a sync, the mean gap per token between vLLM's log-probs of a sequence (the prompt and the trained
    student's greedy reply, `new_tokens` long) and the student's, and the starting model's (the adapter off): the sync
    worked where vLLM sits far nearer the student. tests/test_sdft_vllm.py asserts it."""
    import torch
    from vllm import SamplingParams

    from redumix.data.chat import prompt_ids

    generation, model = trainer.vllm_generation, trainer.model
    generation.sync_weights()
    ids = prompt_ids(tokenizer, prompt)
    with torch.no_grad():
        sequence = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False, pad_token_id=tokenizer.pad_token_id)[0].tolist()
    [scored] = generation.llm.generate([{"prompt_token_ids": sequence}],
                                       SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    reply = range(len(ids), len(sequence))
    theirs = torch.tensor([scored.prompt_logprobs[i][sequence[i]].logprob for i in reply])

    def logprobs() -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([sequence])).logits[0].float().log_softmax(-1)
        return torch.tensor([logits[i - 1, sequence[i]].item() for i in reply])

    student = logprobs()
    with model.disable_adapter():
        start = logprobs()
    return (theirs - student).abs().mean().item(), (theirs - start).abs().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--side", choices=["hf", "vllm"], help=argparse.SUPPRESS)  # one side, in a child process
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-sdft-sampling")
    args = parser.parse_args()
    if args.side:
        print("RESULT " + json.dumps(one_side(args.side, args.steps, args.out)), flush=True)
        return
    totals: dict[str, list[float]] = {"hf": [], "vllm": []}
    for _ in range(args.rounds):
        for side in ("hf", "vllm"):
            child = subprocess.run([sys.executable, "-m", "bench.sdft_sampling", "--side", side, "--steps",
                                    str(args.steps), "--out", str(args.out)], cwd=ROOT, capture_output=True, text=True)
            lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
            if child.returncode or not lines:
                raise SystemExit(f"bench.sdft_sampling: the {side} side failed:\n{child.stderr[-3000:]}")
            result = json.loads(lines[-1].removeprefix("RESULT "))
            print(json.dumps(result), flush=True)
            totals[side].append(result["total_after_first"])
    ratios = [hf / vllm for hf, vllm in zip(totals["hf"], totals["vllm"], strict=True)]
    print(json.dumps({"sdft_step_time_hf_over_vllm": [round(r, 2) for r in ratios]}))


if __name__ == "__main__":
    main()
