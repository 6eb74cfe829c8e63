"""Eval's resumable record store: one JSON Lines file per (checkpoint, decoder), rewritten atomically after each
batch. A record belongs to the model and decoder it was made with (its `model` key, `record_identity`: the weights'
content hash, `lineage.model_id`, the decoder's fingerprint and the engine) and to the problem it answers (its own
`prompt` and `reference`, compared with the example's); records made with anything else are ignored, so a rerun after
a crash scores only what is missing.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tqdm import tqdm

from redumix.common.files import REDO, atomic_write_jsonl, read_jsonl
from redumix.data.task import Example, Task
from redumix.generate.decoder import Decoded


def records_path(folder: Path, checkpoint: str, decoder: str) -> Path:
    return folder / f"{checkpoint}--{decoder.replace('@', '-lam')}.jsonl"


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [record for _, record in read_jsonl(path, fix=REDO)]


def record_identity(weights: str | None, decoder: str, engine: str) -> str:
    """What a record belongs to: the weights' content hash, the decoder's fingerprint, and the engine that decoded it
    where it is not Hugging Face's (`hf`): the engines' replies differ at bf16 near ties, so records of one are not
    resumed as the other's. Which problem it answers is the record's own prompt and reference (`records_for`)."""
    return f"{weights}:{decoder}" + ("" if engine == "hf" else f":{engine}")


# Before records were matched by their prompt, the task's fingerprint (12 hex digits) stood third in their identity.
_WITH_TASK = re.compile(r"([^:]*:[^:]*):[0-9a-f]{12}(:.*)?")


def records_for(path: Path, identity: str, examples: Sequence[Example]) -> dict[str, dict]:
    """The records in `path` of `identity` that answer `examples` (same id, prompt and reference), by id. A record
    written with the task's fingerprint in its identity is read in the current form, and written so with the next
    batch (docs/robustness.md, "Fingerprints and old run folders")."""
    wanted = {example.id: example for example in examples}
    found = {}
    for record in read_records(path):
        example = wanted.get(record.get("id", ""))
        old = _WITH_TASK.fullmatch(str(record.get("model")))
        model = old.group(1) + (old.group(2) or "") if old else record.get("model")
        if example and model == identity and (record.get("prompt"), record.get("reference")) == (
                example.prompt, example.reference):
            found[example.id] = {**record, "model": identity}
    return found


def make_record(
    example: Example, out: Decoded, task: Task, decoder: str, checkpoint: str, identity: str, seconds: float
) -> dict:
    """One example's record. A task with named sub-scores (`sub_scores`, data/task.py) adds them under that key; the
    report gives each one's pass rate."""
    record = {
        "id": example.id,
        "checkpoint": checkpoint,
        "decoder": decoder,
        "model": identity,
        "prompt": example.prompt,
        "reference": example.reference,
        "output": out.text,
        "answer": task.answer(out.text),
        "correct": task.is_correct(out.text, example),
        "tokens": out.usage.visible_tokens,
        "fpe": out.usage.fpe,
        "prefill_tokens": out.usage.prefill_tokens,
        "seconds": round(seconds, 5),
        "extra": out.extra,
    }
    sub_scores = getattr(task, "sub_scores", None)
    if sub_scores is not None:
        record["sub_scores"] = sub_scores(out.text, example)
    return record


def score_resumable(
    path: Path,
    identity: str,
    examples: Sequence[Example],
    decode: Callable[[list[Example]], list[Decoded]],
    to_record: Callable[[Example, Decoded, float], dict],
    batch_size: int,
    desc: str,
) -> list[dict]:
    """Records of `examples` in order: those already in `path` for `identity`, the rest decoded batch by batch."""
    done = records_for(path, identity, examples)
    todo = [e for e in examples if e.id not in done]
    bar = tqdm(total=len(examples), initial=len(examples) - len(todo), desc=desc, unit="ex")
    for start in range(0, len(todo), batch_size):
        batch = todo[start : start + batch_size]
        began = time.perf_counter()
        outputs = decode(batch)
        seconds = (time.perf_counter() - began) / len(batch)
        for example, output in zip(batch, outputs, strict=True):
            done[example.id] = to_record(example, output, seconds)
        wanted = [done[e.id] for e in examples if e.id in done]
        atomic_write_jsonl(path, wanted)
        bar.update(len(batch))
        bar.set_postfix(acc=f"{sum(r['correct'] for r in wanted) / len(wanted):.2f}")
    bar.close()
    return [done[e.id] for e in examples]


def prompt_grades(records: Sequence[dict]) -> list[dict]:
    """Each record as the line a repository can keep (`redumix grades`): the problem, pass or fail, the reply's
    length in tokens and a hash of the reply, which says whether two runs replied alike without holding the reply."""
    return [{"id": r["id"], "correct": r["correct"], "tokens": r["tokens"],
             "sha256": text_digest(r["output"])} for r in records]


def text_digest(text: str) -> str:
    """The first 16 hex digits of a text's SHA-256: two runs that replied alike have the same, without the reply."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]
