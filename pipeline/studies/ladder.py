"""`redumix ladder`: on train problems, does a redo after feedback beat a second try?

A retry that fixes nothing beyond what resampling fixes brings nothing, so every redo is set against a second,
independent sample of the same model from x alone at the redo's temperature (the `resample` arm; with a greedy redo
it is the attempt again). The redo's levers are the harvest's keys (`redumix.instruction`,
`redumix.redo_temperature`), so the protocol a ladder chooses is the one a recipe freezes. Per problem, on one
cache: a greedy attempt (`sampling`), the feedback (`ladder.feedback`: the verifier's, or on code the reference
solution shown as privileged feedback), one reflection, then one redo per λ in `ladder.lams` from clones of the two
contexts; with `ladder.self_critique`, the same again with the model's own critique as the
feedback, at `redumix.lam`. With `ladder.resamples` k > 1, k independent second tries (k attempts per problem), and
the table sets each redo with one resample (keep the one the verifier passes) against two resamples, at equal
samples. Records go to RUN_DIR/ladder/ after every batch (a rerun resumes, a larger `ladder.n` adds problems and a
larger `ladder.resamples` samples); the table, with paired intervals, to ladder.md and summary.json, a repair, a repeat
and a break of each arm to examples.md, and the per-problem grades the table is computed from (no reply text) to
grades.jsonl, the file to commit.
docs/real-models.md holds the ladder over real models that this measures.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from redumix.common.files import atomic_write_json, atomic_write_jsonl, atomic_write_text, read_json, read_jsonl
from redumix.common.fingerprints import ladder_record_v0
from redumix.common.ranks import print0
from redumix.data.chat import batch_template_pieces
from redumix.data.prompts import attempt_messages
from redumix.data.task import Example, Task
from redumix.data.tasks import make_task, task_record
from redumix.generate.engine import Engine
from redumix.generate.loop import Generation
from redumix.generate.redumix import FeedbackFn, RedoStages, redo_contexts, redo_policy, stage_seeds, task_feedback
from redumix.pipeline.config import Config
from redumix.pipeline.embedded_stage import ensure_embedded
from redumix.pipeline.engines import check_engine, open_engine
from redumix.pipeline.harvest_folder import claim_settings, settings_differences
from redumix.pipeline.records import text_digest
from redumix.pipeline.run import RunDir, model_path
from redumix.pipeline.studies.ladder_report import RESAMPLE, ladder_examples, ladder_table, summarize_ladder


def resample_names(count: int) -> list[str]:
    """`resample`, `resample2`, ...: independent second tries from x alone."""
    return [RESAMPLE, *(f"{RESAMPLE}{j}" for j in range(2, count + 1))]


def arm_names(config: Config) -> list[str]:
    """The arms, baselines first: the resamples, `{ladder.feedback}@λ` per λ (`verifier@0.5`, `reference@0`),
    `self@λ` for the self-critique at redumix.lam."""
    names = [*resample_names(config.ladder.resamples), *redo_arms(config)]
    return names + ([f"self@{config.redumix.lam:g}"] if config.ladder.self_critique else [])


def redo_arms(config: Config) -> list[str]:
    return [f"{config.ladder.feedback}@{lam:g}" for lam in config.ladder.lams]


def run_ladder(config: Config, run: RunDir) -> None:
    task = make_task(config.task, config.seed)
    ladder = config.ladder
    examples = task.examples("train", ladder.skip + ladder.n)[ladder.skip :]
    if not examples:
        raise ValueError(f"ladder: task {task.name!r} gives no train examples (ladder.skip, ladder.n)")
    out = run.root / "ladder"
    records_path = out / "records.jsonl"
    records = {r["id"]: r for _, r in read_jsonl(records_path)} if records_path.exists() else {}
    committed = committed_grades(config, {e.id for e in examples} - set(records))
    if committed:
        print0(f"ladder: {len(committed)} of {len(examples)} problems read from the grades in {ladder.records}")
    todo = [e for e in examples if e.id not in records and e.id not in committed]
    wanted = resample_names(ladder.resamples)
    more = [e for e in examples if e.id in records and not set(wanted) <= set(records[e.id]["arms"])]
    # Before the folder is claimed, a model the engine cannot run is refused; a folder with every record written is
    # only summarized, so it needs no engine (and no vLLM installed).
    if todo or more:
        ensure_embedded(config, run)  # the embedded default is built first, so the engine checks the model itself
        check_engine(config, run)
    out.mkdir(parents=True, exist_ok=True)
    claim_settings(out / "settings.json", ladder_record(config), "ladder records",
                   "use another --run-dir, or delete that folder to measure again", ladder_record_v0)
    if any(e.id in records for e in examples):
        print0(f"ladder: resuming, {sum(e.id in records for e in examples)} of {len(examples)} problems already in "
               f"{records_path}"
               + (f"; {len(more)} of them get more resamples" if more else ""))
    if todo or more:
        path = model_path(config.model.path, run)
        engine = open_engine(config, path)
        for work, desc in ((todo, "ladder"), (more, "ladder: more resamples")):
            bar = tqdm(total=len(work), desc=desc, unit="problem", disable=not work)
            for start in range(0, len(work), ladder.batch_size):
                batch = work[start : start + ladder.batch_size]
                with torch.no_grad():
                    if work is todo:
                        records |= {r["id"]: r for r in ladder_batch(engine, task, batch, config)}
                    else:
                        add_resamples(engine, task, batch, [records[e.id] for e in batch], config)
                atomic_write_jsonl(records_path, records.values(), ensure_ascii=False)  # a crash loses one batch
                write_grades(out, config, examples, records, committed)  # copied to docs/records/ mid-run too
                bar.update(len(batch))
            bar.close()
        engine.close()
    rows = [records[e.id] for e in examples if e.id in records]
    summary = write_grades(out, config, examples, records, committed)
    # Committed grades hold no text: the examples are drawn from the problems decoded in this run folder.
    decoded_summary = summary if len(rows) == len(examples) else (
        summarize_ladder(ladder_grades(rows), arm_names(config)) if rows else None)
    atomic_write_text(out / "examples.md", ladder_examples(rows, decoded_summary) if decoded_summary else
                      "# The ladder's examples\n\nEvery problem was read from committed grades: none to show.\n")
    print0(ladder_table(summary))


def write_grades(out: Path, config: Config, examples: Sequence[Example], records: dict[str, dict],
                 committed: dict[str, dict]) -> dict:
    """grades.jsonl, summary.json and ladder.md for every problem measured so far, in the examples' order: written
    after each batch, so an interrupted sitting's grades can be committed and read back through `ladder.records`."""
    decoded = {g["id"]: g for g in ladder_grades([records[e.id] for e in examples if e.id in records])}
    grades = [decoded.get(e.id) or committed[e.id] for e in examples if e.id in decoded or e.id in committed]
    summary = summarize_ladder(grades, arm_names(config))  # what the committed grades alone give again
    summary["settings"] = ladder_record(config)
    atomic_write_json(out / "summary.json", summary)
    atomic_write_jsonl(out / "grades.jsonl", grades)
    atomic_write_text(out / "ladder.md", ladder_table(summary))
    return summary


def committed_grades(config: Config, wanted: set[str]) -> dict[str, dict]:
    """The grade lines of `ladder.records` (an earlier sitting's committed grades.jsonl) for the `wanted` problems
    that hold every arm of this ladder; the folder's summary.json must hold this ladder's settings."""
    if not config.ladder.records:
        return {}
    folder = Path(config.ladder.records)
    for name in ("grades.jsonl", "summary.json"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"ladder.records: {folder / name} not found; give a folder that "
                                    "`redumix ladder` wrote grades.jsonl and summary.json to")
    changed = settings_differences(read_json(folder / "summary.json")["settings"], ladder_record(config))
    if changed:
        raise ValueError(f"ladder.records: {folder} was measured with other settings ({', '.join(changed)}); use "
                         "those settings, or another records folder")
    arms = set(arm_names(config))
    return {g["id"]: g for _, g in read_jsonl(folder / "grades.jsonl") if g["id"] in wanted and arms <= set(g["arms"])}


Texts = list[tuple[str, int]]  # per problem: a reply's text and its token count


def redos(engine: Engine, config: Config, prompts: list[str], ids: list[str], feedback: FeedbackFn | None,
          lams: Sequence[float]) -> tuple[RedoStages, dict[float, Texts]]:
    """Stages 1-3, then one redo per λ from the same two contexts (forks of them but for the last λ). Each stage
    draws with its per-problem seeds, whichever engine decodes."""
    stages, x, x2, _ = redo_contexts(engine, prompts, ids, config.redumix, config.sampling, config.seed, feedback)
    seeds, policy = stage_seeds(config.seed, ids, "redo"), redo_policy(config.redumix, config.sampling)
    found = {}
    for k, lam in enumerate(lams):
        contexts = (x, x2) if k == len(lams) - 1 else (engine.fork(x), engine.fork(x2))
        redo = engine.mix_redo(*contexts, seeds, lam, config.redumix.topk, policy)
        found[lam] = reply_texts(engine, (r.generation for r in redo))
    return stages, found


def resamples(engine: Engine, config: Config, x_ids: list[list[int]], ids: Sequence[str],
              names: Sequence[str]) -> dict[str, Texts]:
    """Each named second try from x alone, at the redo's temperature."""
    policy = redo_policy(config.redumix, config.sampling)
    return {name: reply_texts(engine, engine.sample(x_ids, resample_seeds(config, ids, name), policy))
            for name in names}


def resample_seeds(config: Config, ids: Sequence[str], name: str) -> list[int]:
    """The first resample shares the redo's per-problem seeds; each later one has its own, so that a resample is the
    same whatever else runs with it (the rft arm's samples draw these too)."""
    return stage_seeds(config.seed, ids, "redo" if name == RESAMPLE else name)


def reply_texts(engine: Engine, gens: Iterable[Generation]) -> Texts:
    """Each generation's reply text (up to its stop token) and its token count, as `graded` takes them."""
    return [(engine.tokenizer.decode(g.content_ids(engine.stop_ids), skip_special_tokens=True), len(g.token_ids))
            for g in gens]


def ladder_batch(engine: Engine, task: Task, batch: Sequence[Example], config: Config) -> list[dict]:
    """One record per problem: the attempt, its feedback and reflection, and every arm's answer, graded."""
    ladder = config.ladder
    prompts, ids = [e.prompt for e in batch], [e.id for e in batch]
    stages, redone = redos(engine, config, prompts, ids, task_feedback(ladder.feedback, task, batch, config.seed),
                           ladder.lams)
    if redo_policy(config.redumix, config.sampling).greedy:  # a second greedy try is the attempt itself
        second = {RESAMPLE: [(t, len(a.token_ids)) for t, a in zip(stages.y1_text, stages.attempts, strict=True)]}
    else:
        second = resamples(engine, config, stages.x_ids, ids, resample_names(ladder.resamples))
    critique = redos(engine, config, prompts, ids, None, [config.redumix.lam]) if ladder.self_critique else None

    records = []
    for i, example in enumerate(batch):
        arms = {name: graded(task, texts[i], example) for name, texts in second.items()}
        arms |= {name: graded(task, redone[lam][i], example) for name, lam in zip(redo_arms(config), ladder.lams,
                                                                                 strict=True)}
        attempt = (stages.y1_text[i], len(stages.attempts[i].token_ids))
        record = {"id": example.id, "attempt": graded(task, attempt, example),
                  "feedback": stages.r_text[i], "reflection": stages.c_text[i]}
        if critique is not None:
            self_stages, self_texts = critique
            arms[f"self@{config.redumix.lam:g}"] = graded(task, self_texts[config.redumix.lam][i], example)
            record |= {"critique": self_stages.r_text[i], "self_reflection": self_stages.c_text[i]}
        records.append(record | {"arms": arms})
    return records


def add_resamples(engine: Engine, task: Task, batch: Sequence[Example], records: Sequence[dict],
                  config: Config) -> None:
    """Adds the resamples that `ladder.resamples` asks for and these records lack (in place)."""
    missing = [n for n in resample_names(config.ladder.resamples) if any(n not in r["arms"] for r in records)]
    conversations = [attempt_messages(e.prompt) for e in batch]
    x_ids = [pieces[0] for pieces in batch_template_pieces(engine.tokenizer, conversations)]
    texts = resamples(engine, config, x_ids, [e.id for e in batch], missing)
    for i, (example, record) in enumerate(zip(batch, records, strict=True)):
        record["arms"] |= {n: graded(task, texts[n][i], example) for n in missing if n not in record["arms"]}


def graded(task: Task, text_and_tokens: tuple[str, int], example: Example) -> dict:
    text, tokens = text_and_tokens
    return {"text": text, "answer": task.answer(text), "correct": task.is_correct(text, example), "tokens": tokens}


def ladder_grades(records: Sequence[dict]) -> list[dict]:
    """Each record as the line a repository can keep (docs/records/): per problem, the attempt's and every arm's pass
    or fail, token count, and hashes of the answer and the text. That is all `summarize_ladder` reads, so the table
    is recomputed from these lines alone, without the replies."""
    def line(graded: dict) -> dict:
        answer = graded["answer"]
        return {"correct": graded["correct"], "tokens": graded["tokens"],
                "answer": None if answer is None else text_digest(answer), "text": text_digest(graded["text"].strip())}

    return [{"id": r["id"], "attempt": line(r["attempt"]),
             "arms": {name: line(arm) for name, arm in r["arms"].items()},
             "reflection_quotes_attempt": quotes_attempt(r["reflection"], r["attempt"]["answer"])} for r in records]


def quotes_attempt(reflection: str, answer: str | None) -> bool:
    """The reflection's first code block is the attempt again: each of its lines, comments and blank lines aside, is
    a line of the attempt's answer (the last line of an unclosed block is left out: the reflection's token cap cut
    it). A small model's reflection often ends "Here's the corrected code:" and writes the wrong attempt back
    (docs/code.md)."""
    block = re.search(r"```[a-z]*\n(.*?)(```|\Z)", reflection, re.S)
    if block is None or not answer:
        return False
    code_lines = lambda text: [ln.split("#")[0].rstrip() for ln in text.splitlines() if ln.split("#")[0].strip()]  # noqa: E731
    quoted = code_lines(block.group(1))
    if not block.group(2) and len(quoted) > 1:
        quoted = quoted[:-1]
    return bool(quoted) and set(quoted) <= set(code_lines(answer))


def ladder_record(config: Config) -> dict:
    """What fixes a record, in the record's own names (common/fingerprints.py): the seed, the task, the model's path
    and dtype, `sampling`, the redumix keys the ladder reads (the reflection's length, the redo's instruction and
    effective temperature; λ and the critique's length for the self-critique arm alone) and its levers, and the engine,
    since a ladder's records come from one engine. Not `redumix.feedback` or `feedback_file` (the ladder sets its
    feedback, `ladder.feedback`, and the self-critique itself), `redumix.topk` (the redo's texts draw from p_mix
    whole), the device, compile_decoding or the batch sizes, nor n, skip or the number of resamples, which only add
    to the records, nor `ladder.records`, where some of them were read from.
    `ladder.feedback` is recorded when it is not the verifier, so the records made before the key stand."""
    sampling, redumix, ladder = config.sampling, config.redumix, config.ladder
    critique = ladder.self_critique
    return {"seed": config.seed, "task": task_record(config.task),
            "model": {"path": config.model.path, "dtype": config.model.dtype},
            "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                         "max_new_tokens": sampling.max_new_tokens},
            "redumix": {"reflection_max_tokens": redumix.reflection_max_tokens, "instruction": redumix.instruction,
                        "redo_temperature": redo_policy(redumix, sampling).temperature,
                        "lam": redumix.lam if critique else None,
                        "critique_max_tokens": redumix.critique_max_tokens if critique else None},
            "ladder": {"lams": list(ladder.lams), "self_critique": critique,
                       **({"feedback": ladder.feedback} if ladder.feedback != "verifier" else {})},
            "engine": config.engine}
