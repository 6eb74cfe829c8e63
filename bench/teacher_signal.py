"""What an on-policy teacher shown x2 says at the results of the student's own samples (the SDFT evidence arms).

On `--rows` harvested train problems the model samples y from x alone, as SDFT's student does (T=1). At every
result it writes (the first digit after " = "), this reads the argmax of the model under x ‖ y (the student) and
under x2 ‖ y (SDFT's teacher: the same model shown the attempt, feedback and reflection) and compares each with the
right first digit of that line's own operation. A teacher helps where the student's sample is wrong and it is right.

    .venv/bin/python -m bench.teacher_signal --model models/tiny-base --harvest runs/tiny/harvest
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from redumix.data.chat import prompt_ids
from redumix.data.prompts import attempt_messages
from redumix.data.shards import load_shards
from redumix.generate.model_io import ModelConfig, load_model
from redumix.train.onpolicy import context_logits

LINE = re.compile(r"(-?\d+) ([+\-*]) (-?\d+) = $")


def right_result(prefix: str) -> str | None:
    """The right value of the operation that `prefix` (the text of y so far) ends on with ' = ', if it does."""
    match = LINE.search(prefix.rsplit("\n", 1)[-1])
    if not match:
        return None
    a, op, b = int(match[1]), match[2], int(match[3])
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--harvest", required=True)
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.model, ModelConfig(path=args.model, device="cpu"))
    rows = load_shards(Path(args.harvest)).select(range(args.rows))
    counts = {"results": 0, "sample_wrong": 0, "student_right": 0, "teacher_right": 0,
              "student_right_where_wrong": 0, "teacher_right_where_wrong": 0}
    for start in range(0, len(rows), 50):
        batch = rows.select(range(start, min(start + 50, len(rows))))
        xs = [prompt_ids(tokenizer, attempt_messages(p)) for p in batch["prompt"]]
        x2s = [list(ids) for ids in batch["x2_token_ids"]]
        width = max(map(len, xs))
        padded = torch.tensor([[tokenizer.pad_token_id] * (width - len(x)) + x for x in xs])
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(x) for x in xs])[:, None]).long()
        out = model.generate(padded, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=80, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        ys = [[t for t in row[width:].tolist() if t != tokenizer.pad_token_id] for row in out]
        student = context_logits(model, xs, ys, tokenizer.pad_token_id)
        teacher = context_logits(model, x2s, ys, tokenizer.pad_token_id)
        for y, s_logits, t_logits in zip(ys, student, teacher, strict=True):
            for i in range(1, len(y)):
                right = right_result(tokenizer.decode(y[:i]))
                if right is None:
                    continue
                digit = tokenizer.convert_tokens_to_ids(right[0])
                wrong = y[i] != digit
                s_right = int(s_logits[i].argmax()) == digit
                t_right = int(t_logits[i].argmax()) == digit
                counts["results"] += 1
                counts["sample_wrong"] += wrong
                counts["student_right"] += s_right
                counts["teacher_right"] += t_right
                counts["student_right_where_wrong"] += s_right and wrong
                counts["teacher_right_where_wrong"] += t_right and wrong
    n, wrong = counts["results"], max(counts["sample_wrong"], 1)
    print(f"{args.rows} problems, {n} results in the student's samples at T=1; the sample's digit is wrong at "
          f"{counts['sample_wrong']} ({counts['sample_wrong'] / n:.1%})")
    print("| argmax at a result | right, all results | right, where the sample is wrong |")
    print("|---|---|---|")
    for who in ("student", "teacher"):
        print(f"| {who} | {counts[who + '_right'] / n:.1%} | {counts[who + '_right_where_wrong'] / wrong:.1%} |")


if __name__ == "__main__":
    main()
