"""How far the stored targets lie from the model they will train (the seed's stability argument, measured).

For each harvest row, over the tokens of its redo: the per-token KL(p_target ‖ p_model(· | x, y<t)) of the stored
sparse target (top-k + tail, the same buckets the loss uses) from the model shown x alone, and the entropy of the
target over those buckets (a lower bound on the full entropy: the tail counts as one outcome). Each harvest's mean
over rows has a 95% normal interval; with two harvests, their difference too (rows are not paired: each harvest has
its own redos). The seed argues that λ=0.5 keeps the target near the model where λ=0 (the reflective context alone)
puts feedback-specific tokens in its low-probability region.

    .venv/bin/python -m bench.target_stability --model models/smollm2-135m-instruct \
        --harvest runs/smol-lam05/harvest runs/smol-lam0/harvest
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from redumix.generate.model_io import ModelConfig, load_model
from redumix.train.data import SparseTeacherCollator, build_examples, load_harvest
from redumix.train.loss import generalized_jsd, select_targets, sparse_student_buckets, sparse_teacher_buckets


@torch.no_grad()
def row_measures(model, examples, pad_token_id: int) -> list[tuple[float, float]]:
    """(mean per-token KL(target ‖ model), mean per-token target entropy) for each example."""
    collate = SparseTeacherCollator(pad_token_id=pad_token_id)
    out = []
    for i in range(len(examples)):
        batch = collate([examples[i]])
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        student, _ = select_targets(logits, batch["labels"])
        mask = batch["teacher_mask"]
        ids, logprobs = batch["teacher_ids"][mask], batch["teacher_logprobs"][mask]
        tail = batch["teacher_tail"][mask] if "teacher_tail" in batch else None
        valid = torch.isfinite(logprobs)
        student_log, full_support = sparse_student_buckets(student, ids, valid)
        teacher_log = sparse_teacher_buckets(logprobs, 1.0, full_support, tail)
        kl = generalized_jsd(student_log, teacher_log, 0.0)
        p = teacher_log.exp()
        entropy = -(p * torch.where(p > 0, teacher_log, 0.0)).sum(-1)
        out.append((float(kl.mean()), float(entropy.mean())))
    return out


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / max(n - 1, 1))
    half = 1.96 * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def main(argv: list[str] | None = None) -> dict[str, dict[str, tuple[float, float, float]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--harvest", nargs="+", required=True)
    parser.add_argument("--max-length", type=int, default=768)
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model, ModelConfig(path=args.model, device="cpu"))
    model.eval()
    measures, summary = {}, {}
    print("| harvest | rows | λ | KL(target ‖ model under x) per token [95% CI] | target entropy per token [95% CI] |")
    print("|---|---|---|---|---|")
    for folder in args.harvest:
        rows = load_harvest(Path(folder))
        examples = build_examples(rows, tokenizer, args.max_length)
        measures[folder] = row_measures(model, examples, tokenizer.pad_token_id)
        kl = mean_interval([m[0] for m in measures[folder]])
        entropy = mean_interval([m[1] for m in measures[folder]])
        summary[folder] = {"kl": kl, "entropy": entropy}
        lam = sorted(set(rows["lam"])) if "lam" in rows.column_names else "?"
        print(f"| {folder} | {len(examples)} | {lam} | {kl[0]:.3f} [{kl[1]:.3f}, {kl[2]:.3f}] | "
              f"{entropy[0]:.3f} [{entropy[1]:.3f}, {entropy[2]:.3f}] |")
    if len(args.harvest) == 2:
        a, b = (summary[f] for f in args.harvest)
        for key in ("kl", "entropy"):
            n_a, n_b = len(measures[args.harvest[0]]), len(measures[args.harvest[1]])
            se = math.sqrt(((a[key][2] - a[key][0]) / 1.96) ** 2 + ((b[key][2] - b[key][0]) / 1.96) ** 2)
            diff = a[key][0] - b[key][0]
            print(f"{key}: first − second = {diff:+.3f} [{diff - 1.96 * se:+.3f}, {diff + 1.96 * se:+.3f}] "
                  f"(rows {n_a} and {n_b}, not paired)")
    return summary


if __name__ == "__main__":
    main()
