"""Where the small model goes wrong, is it unsure, and is the guide right there? (speculative-thinking's gate)

On `--rows` train problems the small model answers greedily. At every result it writes (the first digit after
" = ", the delimiter points where a handover matters in the embedded world), this reads the small model's top-1
probability and both models' argmax, and compares each with the right first digit of that line's own operation.
An uncertainty gate can only hand the wrong results to the guide if they sit below its threshold while the right
ones do not.

    .venv/bin/python -m bench.guide_signal --small models/tiny-base --guide models/tiny-guide
"""

from __future__ import annotations

import argparse

import torch

from bench.teacher_signal import right_result
from redumix.data.chat import prompt_ids
from redumix.data.prompts import attempt_messages
from redumix.data.tasks import make_task
from redumix.generate.model_io import ModelConfig, load_model
from redumix.pipeline.config import load_config
from redumix.train.onpolicy import context_logits

THRESHOLDS = (0.5, 0.7, 0.9, 0.99)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", required=True)
    parser.add_argument("--guide", required=True)
    parser.add_argument("--rows", type=int, default=500)
    args = parser.parse_args()
    config = load_config("tiny", [])
    small, tokenizer = load_model(args.small, ModelConfig(path=args.small, device="cpu"))
    guide, _ = load_model(args.guide, ModelConfig(path=args.guide, device="cpu"))
    examples = make_task(config.task, config.seed).examples("train", args.rows)
    results = []  # (small's top-1 probability, small's argmax right, guide's argmax right)
    for start in range(0, len(examples), 100):
        xs = [prompt_ids(tokenizer, attempt_messages(e.prompt)) for e in examples[start:start + 100]]
        width = max(map(len, xs))
        padded = torch.tensor([[tokenizer.pad_token_id] * (width - len(x)) + x for x in xs])
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(x) for x in xs])[:, None]).long()
        out = small.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=80,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        ys = [[t for t in row[width:].tolist() if t != tokenizer.pad_token_id] for row in out]
        for y, s_logits, g_logits in zip(ys, context_logits(small, xs, ys, tokenizer.pad_token_id),
                                         context_logits(guide, xs, ys, tokenizer.pad_token_id), strict=True):
            for i in range(1, len(y)):
                right = right_result(tokenizer.decode(y[:i]))
                if right is None:
                    continue
                digit = tokenizer.convert_tokens_to_ids(right[0])
                top1 = float(s_logits[i].float().softmax(-1).max())
                results.append((top1, int(s_logits[i].argmax()) == digit, int(g_logits[i].argmax()) == digit))
    wrong = [r for r in results if not r[1]]
    right = [r for r in results if r[1]]
    print(f"{args.rows} train problems, {len(results)} results in the small model's greedy answers; its argmax is "
          f"wrong at {len(wrong)} ({len(wrong) / len(results):.1%}); the guide's argmax is right at "
          f"{sum(r[2] for r in wrong) / max(len(wrong), 1):.1%} of those and "
          f"{sum(r[2] for r in right) / max(len(right), 1):.1%} of the small model's right ones")
    print("| small's top-1 below | share of its wrong results | share of its right results | guide right there |")
    print("|---|---|---|---|")
    for threshold in THRESHOLDS:
        below = [r for r in results if r[0] < threshold]
        print(f"| {threshold} | {sum(not r[1] for r in below) / max(len(wrong), 1):.1%} | "
              f"{sum(r[1] for r in below) / max(len(right), 1):.1%} | "
              f"{sum(r[2] for r in below) / max(len(below), 1):.1%} |")


if __name__ == "__main__":
    main()
