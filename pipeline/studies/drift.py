"""How far a tuned model has moved from its base: the seed's stability claim, measured on the model rather than on
its targets. Three measures, each per token:

- on the task: KL(tuned ‖ base) over the tuned model's own greedy answers to the task's test prompts;
- outside the task: KL(tuned ‖ base) over the base's greedy answers to plain questions from a JSONL file (GSM8K's
  `question`s, say), the same tokens for every model compared, so that models are paired token by token;
- general text: the mean negative log-likelihood of reference texts from the same file (its `answer`s), read as
  plain text with no chat template.

A regulariser should drift less on all three. `redumix evidence` and `redumix rounds` call these.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from redumix.common.files import read_jsonl
from redumix.data.chat import prompt_ids
from redumix.data.prompts import attempt_messages
from redumix.generate.model_io import load_model
from redumix.generate.policy import SamplingPolicy
from redumix.pipeline.config import Config
from redumix.pipeline.engines import batch_size, open_engine
from redumix.train.data import end_of_turn_ids
from redumix.train.onpolicy import context_logits


@dataclass(frozen=True)
class GeneralSet:
    """Plain questions and reference texts outside the task, read from one JSONL file."""

    questions: list[str]
    texts: list[str]


def read_general_set(path: Path, n: int) -> GeneralSet:
    """The first `n` lines of a JSONL file of `question` and `answer` strings (GSM8K's layout)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"evidence.general_path: {path} is not a file; point it at a JSONL file of "
                                "'question'/'answer' objects (../shared/data/gsm8k/test.jsonl, say) or set it to null")
    questions, texts = [], []
    for line_no, row in read_jsonl(path):
        if not (isinstance(row, dict) and isinstance(row.get("question"), str) and isinstance(row.get("answer"), str)
                and row["question"].strip() and row["answer"].strip()):
            raise ValueError(f"{path}:{line_no}: expected an object with non-empty 'question' and 'answer' strings; "
                             "fix or remove that line")
        questions.append(row["question"].strip())
        texts.append(row["answer"].strip())
        if len(questions) == n:
            break
    if not questions:
        raise ValueError(f"{path}: no JSON lines; evidence.general_path needs 'question'/'answer' objects")
    return GeneralSet(questions, texts)


def task_answers(tokenizer, records: list[dict]) -> tuple[list[list[int]], list[list[int]]]:
    """Prompt ids and answer ids (end of turn included) of eval records: a model's greedy answers to the task."""
    end = end_of_turn_ids(tokenizer)
    xs = [prompt_ids(tokenizer, attempt_messages(r["prompt"])) for r in records]
    ys = [tokenizer(r["output"], add_special_tokens=False)["input_ids"] + end for r in records]
    return xs, ys


def greedy_answers(config: Config, model_path: Path, questions: Sequence[str]) -> list[list[int]]:
    """The model's greedy answer ids to each question asked as a chat turn (the stop token kept when it stopped), on
    recipe's `engine`: the base's answers are the evaluation's longest decode outside the test."""
    policy = SamplingPolicy(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=config.sampling.max_new_tokens)
    engine = open_engine(config, model_path)
    batch = batch_size(config, 16)
    answers = []
    for start in tqdm(range(0, len(questions), batch), desc="drift: the base's answers off the task", unit="batch"):
        prompts = [prompt_ids(engine.tokenizer, attempt_messages(q)) for q in questions[start : start + batch]]
        answers += [g.token_ids for g in engine.sample(prompts, [0] * len(prompts), policy)]
    engine.close()
    return answers


# A forward's logits are rows x width x vocab floats, kept until the chunk is scored: at Qwen's 151,936-token
# vocabulary, 16 rows of 500 tokens are 4.9 GB a model, and the two models' logits with the evidence stage's own
# memory ran a 24 GiB host out of memory (2026-11-28). So a chunk holds at most this many bytes of logits.
LOGIT_BYTES_PER_FORWARD = 1 << 30


def chunks_within(lengths: Sequence[int], rows: int, vocab: int, max_bytes: int | None = None) -> list[list[int]]:
    """Consecutive index chunks of at most `rows` rows whose padded forward (rows x longest x vocab float32 logits)
    stays within `max_bytes` (LOGIT_BYTES_PER_FORWARD); a row longer than the budget gets a chunk of its own."""
    positions = max(1, (max_bytes or LOGIT_BYTES_PER_FORWARD) // (4 * vocab))
    chunks: list[list[int]] = []
    for index, length in enumerate(lengths):
        last = chunks[-1] if chunks else None
        if last and len(last) < rows and (len(last) + 1) * max(length, *(lengths[i] for i in last)) <= positions:
            last.append(index)
        else:
            chunks.append([index])
    return chunks


def vocab_size(model) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


@torch.no_grad()
def kl_per_token(
    tuned, base, xs: list[list[int]], ys: list[list[int]], pad_id: int, batch: int = 16, desc: str = "drift: KL"
) -> float:
    """Mean per-token KL(tuned ‖ base) over the continuations ys after the prompts xs (rows with no tokens skipped)."""
    total, tokens = 0.0, 0
    pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if y]
    for chunk in tqdm(chunks_within([len(x) + len(y) for x, y in pairs], batch, vocab_size(tuned)), desc=desc,
                      unit="batch"):
        chunk_x, chunk_y = zip(*(pairs[i] for i in chunk), strict=True)
        on_tuned = context_logits(tuned, list(chunk_x), list(chunk_y), pad_id)
        on_base = context_logits(base, list(chunk_x), list(chunk_y), pad_id)
        for logits_t, logits_b in zip(on_tuned, on_base, strict=True):
            log_t, log_b = torch.log_softmax(logits_t, -1), torch.log_softmax(logits_b, -1)
            total += float((log_t.exp() * (log_t - log_b)).sum())
            tokens += log_t.shape[0]
    return total / tokens if tokens else math.nan


@torch.no_grad()
def text_nll(model, tokenizer, texts: Sequence[str], batch: int = 16, desc: str = "drift: loss on the texts") -> float:
    """Mean negative log-likelihood per token of plain texts (each token after the first, given the ones before)."""
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    ids = [i for i in ids if len(i) > 1]
    total, tokens = 0.0, 0
    for indices in tqdm(chunks_within([len(i) for i in ids], batch, vocab_size(model)), desc=desc, unit="batch"):
        chunk = [ids[i] for i in indices]
        logits = context_logits(model, [i[:1] for i in chunk], [i[1:] for i in chunk], tokenizer.pad_token_id)
        for row_logits, row in zip(logits, chunk, strict=True):
            target = torch.as_tensor(row[1:], device=row_logits.device)
            total -= float(torch.log_softmax(row_logits, -1).gather(1, target[:, None]).sum())
            tokens += len(row) - 1
    return total / tokens if tokens else math.nan


def drift_measures(
    config: Config, tuned_path: Path, base_path: Path, task_records: list[dict],
    general: GeneralSet | None = None, general_answers: list[list[int]] | None = None,
    base_text_nll: float | None = None,
) -> dict[str, float | int]:
    """Every drift measure of a tuned model from its base: on the task (its own greedy answers in `task_records`)
    and, with a general set and the base's answers to its questions, outside the task and on general text.
    `base_text_nll`: the base's loss on the general texts where an earlier arm measured it (the same for every arm;
    on a 1.5B model on a CPU, minutes a time)."""
    tuned, tokenizer = load_model(tuned_path, config.model)
    base, _ = load_model(base_path, config.model)
    xs, ys = task_answers(tokenizer, task_records)
    on_task = kl_per_token(tuned, base, xs, ys, tokenizer.pad_token_id, desc="drift: KL(tuned ‖ base) on its answers")
    result: dict[str, float | int] = {"kl_tuned_base": on_task, "prompts": len(task_records)}
    if general is not None and general_answers is not None:
        questions = [prompt_ids(tokenizer, attempt_messages(q)) for q in general.questions]
        result["kl_offtask"] = kl_per_token(tuned, base, questions, general_answers, tokenizer.pad_token_id,
                                            desc="drift: KL(tuned ‖ base) off the task")
        result["offtask_prompts"] = len(questions)
        result["text_nll"] = text_nll(tuned, tokenizer, general.texts, desc="drift: the tuned loss on the texts")
        result["text_nll_base"] = (text_nll(base, tokenizer, general.texts, desc="drift: the base loss on the texts")
                                   if base_text_nll is None else base_text_nll)
        result["texts"] = len(general.texts)
    return result


def drift_kl(config: Config, tuned_path: Path, base_path: Path, records: list[dict]) -> float:
    """KL(tuned ‖ base) per token over the tuned model's own greedy answers in eval `records`."""
    return float(drift_measures(config, tuned_path, base_path, records)["kl_tuned_base"])
