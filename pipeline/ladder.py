"""`redumix ladder`: on train problems, does a redo after feedback beat a second try?

A retry that fixes nothing beyond what resampling fixes brings nothing, so every redo is set against a second,
independent sample of the same model from x alone at the redo's temperature (the `resample` arm; with a greedy
redo it is the attempt again). Per problem, on one cache: a greedy attempt (`sampling`), the verifier's feedback, one
reflection, then one redo per λ in `ladder.lams` from clones of the two contexts; with `ladder.self_critique`, the
same again with the model's own critique as the feedback, at `redumix.lam`. Records go to RUN_DIR/ladder/ after
every batch (a rerun resumes, and a larger `ladder.n` adds problems); the table, with paired intervals, to
ladder.md and summary.json. docs/real-models.md holds the ladder over real models that this measures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm import tqdm

from redumix.common.files import atomic_write_json, atomic_write_jsonl, atomic_write_text, read_json, read_jsonl
from redumix.common.ranks import print0
from redumix.data.prompts import REDO
from redumix.data.task import Example, Task
from redumix.data.tasks import make_task
from redumix.generate.mixture import mixture_loop
from redumix.generate.model_io import load_model, stop_token_ids
from redumix.generate.plain import generate_batch
from redumix.generate.redumix import redo_contexts, stage_seeds, task_feedback
from redumix.generate.state import clone
from redumix.pipeline.config import Config
from redumix.pipeline.embedded_stage import ensure_embedded
from redumix.pipeline.harvest_folder import settings_differences
from redumix.pipeline.run import RunDir, model_path
from redumix.pipeline.stats import newcombe_paired_interval, wilson_interval

# The redo instruction, a protocol lever: the ReDuMix paper's own; one that asks for a new solution rather than a
# rewrite (small models told to "redo" mostly copy their attempt: arXiv:2507.14295); or one that asks for the answer
# alone (at 200 problems the redos copied the reflection or chatted about the task: docs/real-models.md).
INSTRUCTIONS = {
    "redo": REDO,
    "fresh": "Now solve the task again from the beginning with a new solution. Do not copy your earlier answer: "
             "work it out afresh, using what your reflection found.",
    "answer": "Now reply to my original request again, improved by your reflection. Write only the reply itself: no "
              "greeting, no apology, and nothing about the request or your reflection.",
}
RESAMPLE = "resample"


def arm_names(config: Config) -> list[str]:
    """The arms, baseline first: `verifier@λ` per λ, `self@λ` for the self-critique at redumix.lam."""
    names = [RESAMPLE, *(f"verifier@{lam:g}" for lam in config.ladder.lams)]
    return names + ([f"self@{config.redumix.lam:g}"] if config.ladder.self_critique else [])


def run_ladder(config: Config, run: RunDir) -> None:
    task = make_task(config.task, config.seed)
    ladder = config.ladder
    examples = task.examples("train", ladder.skip + ladder.n)[ladder.skip :]
    if not examples:
        raise ValueError(f"ladder: task {task.name!r} gives no train examples (ladder.skip, ladder.n)")
    out = run.root / "ladder"
    out.mkdir(parents=True, exist_ok=True)
    _claim(out / "settings.json", _settings(config))
    records_path = out / "records.jsonl"
    records = {r["id"]: r for _, r in read_jsonl(records_path)} if records_path.exists() else {}
    todo = [e for e in examples if e.id not in records]
    if len(todo) < len(examples):
        print0(f"ladder: resuming, {len(examples) - len(todo)} of {len(examples)} problems already in {records_path}")
    if todo:
        ensure_embedded(config, run)
        model, tokenizer = load_model(model_path(config.model.path, run), config.model)
        stop_ids = stop_token_ids(model, tokenizer)
        bar = tqdm(total=len(todo), desc="ladder", unit="problem")
        for start in range(0, len(todo), ladder.batch_size):
            batch = todo[start : start + ladder.batch_size]
            with torch.no_grad():
                for record in ladder_batch(model, tokenizer, task, batch, config, stop_ids):
                    records[record["id"]] = record
            atomic_write_jsonl(records_path, records.values(), ensure_ascii=False)  # every batch: a crash loses one
            bar.update(len(batch))
        bar.close()
    rows = [records[e.id] for e in examples]
    summary = summarize_ladder(rows, arm_names(config))
    summary["settings"] = _settings(config)
    atomic_write_json(out / "summary.json", summary)
    table = ladder_table(summary)
    atomic_write_text(out / "ladder.md", table)
    print0(table)


def ladder_batch(model, tokenizer, task: Task, batch: Sequence[Example], config: Config,
                 stop_ids: Sequence[int]) -> list[dict]:
    """One record per problem: the attempt, its feedback and reflection, and every arm's answer, graded."""
    ladder = config.ladder
    prompts, ids = [e.prompt for e in batch], [e.id for e in batch]
    redo_policy = replace(config.sampling, temperature=ladder.redo_temperature)
    redo_seeds = stage_seeds(config.seed, ids, "redo")
    instruction = INSTRUCTIONS[ladder.instruction]
    decode = lambda ids_: tokenizer.decode(ids_, skip_special_tokens=True)  # noqa: E731

    def redos(feedback, lams: Sequence[float]) -> tuple:
        stages, x_context, x2_context, _ = redo_contexts(model, tokenizer, prompts, ids, config.redumix,
                                                         config.sampling, config.seed, stop_ids, feedback, instruction)
        texts = {}
        for k, lam in enumerate(lams):
            last = k == len(lams) - 1  # the last λ may use up the contexts; the others decode from copies
            contexts = (x_context, x2_context) if last else (clone(x_context), clone(x2_context))
            found = mixture_loop(model, *contexts, lam, config.redumix.topk, redo_policy, redo_seeds, stop_ids)
            texts[lam] = [(decode(g.content_ids(stop_ids)), len(g.token_ids)) for g, *_ in found]
        return stages, texts

    stages, verifier = redos(task_feedback("verifier", task, batch, config.seed), ladder.lams)
    if redo_policy.greedy:  # a second greedy try is the attempt itself
        resample = [(t, len(a.token_ids)) for t, a in zip(stages.y1_text, stages.attempts, strict=True)]
    else:
        gens = generate_batch(model, stages.x_ids, redo_policy, redo_seeds.tolist(), stop_ids, tokenizer.pad_token_id)
        resample = [(decode(g.content_ids(stop_ids)), len(g.token_ids)) for g in gens]
    critique = redos(None, [config.redumix.lam]) if ladder.self_critique else None

    def graded(text_and_tokens: tuple[str, int], example: Example) -> dict:
        text, tokens = text_and_tokens
        return {"text": text, "answer": task.answer(text), "correct": task.is_correct(text, example), "tokens": tokens}

    records = []
    for i, example in enumerate(batch):
        arms = {RESAMPLE: graded(resample[i], example)}
        arms |= {f"verifier@{lam:g}": graded(verifier[lam][i], example) for lam in ladder.lams}
        record = {"id": example.id, "attempt": graded((stages.y1_text[i], len(stages.attempts[i].token_ids)), example),
                  "feedback": stages.r_text[i], "reflection": stages.c_text[i]}
        if critique is not None:
            self_stages, self_texts = critique
            arms[f"self@{config.redumix.lam:g}"] = graded(self_texts[config.redumix.lam][i], example)
            record |= {"critique": self_stages.r_text[i], "self_reflection": self_stages.c_text[i]}
        records.append(record | {"arms": arms})
    return records


def _repeats(arm: dict, attempt: dict) -> bool:
    """The arm gives the attempt's answer again (or, with no answer to compare, its text)."""
    if attempt["answer"] is not None or arm["answer"] is not None:
        return arm["answer"] == attempt["answer"]
    return arm["text"].strip() == attempt["text"].strip()


def summarize_ladder(rows: list[dict], arms: list[str]) -> dict:
    """Per arm: accuracy, fixed and broken against the attempt, repeats, and on the wrong attempts the arm against
    the resample, paired (Newcombe's interval over the same problems)."""
    n = len(rows)
    wrong = [r for r in rows if not r["attempt"]["correct"]]
    wrong_ids = {r["id"] for r in wrong}
    attempt_right = n - len(wrong)
    summary: dict = {"n": n, "attempt_correct": attempt_right, "attempt_accuracy": _share(attempt_right, n),
                     "wrong_attempts": len(wrong), "arms": {}}
    for name in arms:
        right = sum(r["arms"][name]["correct"] for r in rows)
        fixed = [r["id"] for r in wrong if r["arms"][name]["correct"]]
        broken = [r["id"] for r in rows if r["attempt"]["correct"] and not r["arms"][name]["correct"]]
        repeats = [r["id"] for r in rows if _repeats(r["arms"][name], r["attempt"])]
        repeats_on_wrong = [i for i in repeats if i in wrong_ids]
        table = {"both": 0, "fixed": 0, "broken": 0, "neither": 0}  # on wrong attempts: the arm against the resample
        for r in wrong:
            arm, base = r["arms"][name]["correct"], r["arms"][RESAMPLE]["correct"]
            table["both" if arm and base else "fixed" if arm else "broken" if base else "neither"] += 1
        summary["arms"][name] = {
            "accuracy": _share(right, n), "accuracy_interval": wilson_interval(right, n),
            "fixed": len(fixed), "broken": len(broken),
            "repeats": _share(len(repeats), n), "repeats_on_wrong": _share(len(repeats_on_wrong), len(wrong)),
            "keep_right_accuracy": _share(attempt_right + len(fixed), n),  # the redo only where the attempt was wrong
            "vs_resample_on_wrong": _share(table["fixed"] - table["broken"], len(wrong)),
            "vs_resample_interval": newcombe_paired_interval(**table), "vs_resample_table": table,
            "mean_tokens": _share(sum(r["arms"][name]["tokens"] for r in rows), n),
            "examples": {"fixed": fixed[:3], "broken": broken[:3], "repeat_on_wrong": repeats_on_wrong[:3]},
        }
    return summary


def _share(part: float, whole: int) -> float:
    return part / whole if whole else math.nan


def ladder_table(summary: dict) -> str:
    """The summary as a markdown table, percentages to one decimal."""
    pct = lambda x: f"{100 * x:.1f}"  # noqa: E731
    lines = [f"n = {summary['n']} train problems; first attempt {pct(summary['attempt_accuracy'])}% right "
             f"({summary['wrong_attempts']} wrong)", "",
             "| arm | accuracy | fixed / broken | repeats the attempt's answer (all / wrong) | on wrong attempts: "
             "arm − resample [95% CI] | redo only the wrong |",
             "|---|---|---|---|---|---|"]
    for name, arm in summary["arms"].items():
        low, high = arm["vs_resample_interval"]
        vs = "–" if name == RESAMPLE else f"{pct(arm['vs_resample_on_wrong'])} [{pct(low)}, {pct(high)}]"
        lines.append(f"| {name} | {pct(arm['accuracy'])}% | {arm['fixed']} / {arm['broken']} | "
                     f"{pct(arm['repeats'])}% / {pct(arm['repeats_on_wrong'])}% | {vs} | "
                     f"{pct(arm['keep_right_accuracy'])}% |")
    return "\n".join(lines) + "\n"


def _settings(config: Config) -> dict:
    """What fixes a record: the model, the task, decoding and the ladder's levers (not n, skip or batch size)."""
    levers = {k: v for k, v in asdict(config.ladder).items() if k not in ("n", "skip", "batch_size")}
    return {"seed": config.seed, "model": asdict(config.model), "task": asdict(config.task),
            "sampling": asdict(config.sampling), "redumix": asdict(config.redumix), "ladder": levers}


def _claim(path: Path, settings: dict) -> None:
    """Records are only resumed under the settings that made them; another setting gets its own run folder."""
    if path.exists():
        changed = settings_differences(read_json(path), settings)
        if changed:
            raise ValueError(f"{path}: the ladder records here were made with other settings ({', '.join(changed)}); "
                             "use another --run-dir, or delete that folder to measure again")
        return
    atomic_write_json(path, settings)
