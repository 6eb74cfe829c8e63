"""`redumix eval`: rerun the decoders on the base and tuned checkpoints over held-out problems, and report what
each decoder buys (accuracy, with a 95% Wilson interval) and what it costs (tokens, FPE, wall time).

Decoders, by name in `eval.decoders` (the `DECODERS` table below maps each name to one call):
  greedy, sample                     plain decoding (sample uses eval.sample_temperature)
  longhand                           greedy, asked to work the long way (visible long-hand CoT)
  vote[@N]                           self-consistency: N sampled answers (pdr.drafts, pdr.draft_temperature), majority
  cntp                               Cautious Next Token Prediction: where entropy is high, sample trials up to the
                                     next punctuation and keep the lowest-perplexity one (visible steps greedy)
  redumix-oracle[@λ], redumix-self   ReDuMix with verifier feedback (it knows the answer, hence "oracle") or the
                                     model's own critique; `@λ` overrides redumix.lam, for the λ sweep
  moi                                Mixture of Inputs
  pdr, sr                            Parallel-Distill-Refine; sr is the same with one draft
  reflective[-periodic|-random|-fixed]  hidden-KV Reflective Decoding and its ablations, matched to the gated
                                     run's hidden budget (the gated run goes first)

A decoder or a task defined elsewhere (a test, a notebook) goes in through `run_eval(config, run, task=...,
decoders={**DECODERS, "name": factory})`, with no edit here.

Resume: each (checkpoint, decoder) keeps its per-example records in `eval/generations/` (pipeline/records.py),
rewritten atomically after every batch. A rerun skips the examples already scored. `report.json` is written last.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from redumix.data.task import Task
from redumix.data.tasks import make_task
from redumix.embedded.stage import ensure_base
from redumix.generate.cntp import CntpDecoder
from redumix.generate.decoder import Decoder, fingerprint
from redumix.generate.model_io import load_model
from redumix.generate.moi import MoiDecoder
from redumix.generate.pdr import PdrDecoder
from redumix.generate.plain import PlainDecoder
from redumix.generate.redumix import RedumixDecoder
from redumix.generate.reflective import ReflectiveDecoder
from redumix.generate.reflective_tuning import matched_ablations
from redumix.pipeline.config import Config, config_to_yaml
from redumix.pipeline.records import make_record, model_identity, read_records, records_path, score_resumable
from redumix.pipeline.report import plot_accuracy_vs_fpe, reflection_diagnostics, report_markdown, summarize
from redumix.pipeline.run import (
    RunDir,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    barrier,
    init_distributed,
    log_metrics,
    model_path,
    peak_rss_mb,
    print0,
    rank,
    read_json,
    world_size,
)

# (config, the decoder's name as listed, records of the decoders already run on this checkpoint) -> decoder
DecoderFactory = Callable[[Config, str, dict[str, list[dict]]], Decoder]


# --- decoders by name -----------------------------------------------------------------------------------------------


def _redumix(feedback: str) -> DecoderFactory:
    def make(config: Config, name: str, earlier: dict[str, list[dict]]) -> Decoder:
        settings = dataclasses.replace(config.redumix, feedback=feedback)
        _, at, lam = name.partition("@")
        if at:
            try:
                settings = dataclasses.replace(settings, lam=float(lam))
            except ValueError as exc:
                raise ValueError(f"eval.decoders: {name!r}: λ must be a number in [0, 1] ({exc})") from exc
        return RedumixDecoder(name, settings, config.sampling, config.seed)

    return make


def _vote(config: Config, name: str, earlier: dict[str, list[dict]]) -> Decoder:
    """Self-consistency at PDR's N and draft temperature: PDR with no refine round is exactly a majority vote."""
    _, at, count = name.partition("@")
    drafts = config.pdr.drafts
    if at:
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"eval.decoders: {name!r}: N must be a whole number >= 1")
        drafts = int(count)
    return PdrDecoder(name, dataclasses.replace(config.pdr, drafts=drafts, rounds=0), config.sampling, config.seed)


def _matched(config: Config, name: str, earlier: dict[str, list[dict]]) -> Decoder:
    """An ablation of the gated reflective run, matched to its hidden budget."""
    gated = earlier.get("reflective")
    if not gated:
        raise ValueError(f"eval.decoders: {name!r} is matched to 'reflective', so list 'reflective' before it")
    visible = sum(r["extra"]["visible_tokens"] for r in gated)
    reflections = sum(r["extra"]["n_reflections"] for r in gated)
    hidden = sum(r["extra"]["hidden_tokens"] for r in gated)
    points = sum(r["extra"]["trigger_points"] for r in gated)  # where a trigger could fire (trigger_after)
    settings = matched_ablations(config.reflective, visible, reflections, hidden, points)[name]
    return ReflectiveDecoder(name, settings, config.sampling, config.seed)


DECODERS: dict[str, DecoderFactory] = {
    "greedy": lambda c, name, _: PlainDecoder(name, dataclasses.replace(c.sampling, temperature=0.0), c.seed),
    "sample": lambda c, name, _: PlainDecoder(
        name, dataclasses.replace(c.sampling, temperature=c.eval.sample_temperature), c.seed
    ),
    "redumix-oracle": _redumix("verifier"),
    "redumix-self": _redumix("self"),
    "longhand": lambda c, name, _: PlainDecoder(
        name, dataclasses.replace(c.sampling, temperature=0.0), c.seed, longhand=True
    ),
    "vote": _vote,
    "cntp": lambda c, name, _: CntpDecoder(name, c.cntp, dataclasses.replace(c.sampling, temperature=0.0), c.seed),
    "moi": lambda c, name, _: MoiDecoder(name, c.moi, c.sampling, c.seed),
    "pdr": lambda c, name, _: PdrDecoder(name, c.pdr, c.sampling, c.seed),
    "sr": lambda c, name, _: PdrDecoder(name, dataclasses.replace(c.pdr, drafts=1), c.sampling, c.seed),
    "reflective": lambda c, name, _: ReflectiveDecoder(name, c.reflective, c.sampling, c.seed),
    "reflective-periodic": _matched,
    "reflective-random": _matched,
    "reflective-fixed": _matched,
}
SUFFIXES = {"redumix-oracle": "@λ", "redumix-self": "@λ", "vote": "@N"}  # the only names that take a suffix


def check_decoder_names(names: list[str], table: dict[str, DecoderFactory]) -> None:
    """Every listed name must be in the table before any model loads; all problems are reported at once."""
    problems = []
    for name in names:
        family, at, _ = name.partition("@")
        if family not in table:
            problems.append(f"unknown decoder {name!r} (known: {', '.join(table)}, redumix-oracle@λ, vote@N)")
        elif at and family not in SUFFIXES:
            takes = ", ".join(f"{k}{v}" for k, v in SUFFIXES.items())
            problems.append(f"decoder {name!r}: only these take an @ suffix: {takes}")
    if problems:
        raise ValueError("eval.decoders: " + "; ".join(problems))


# --- the stage ----------------------------------------------------------------------------------------------------


def run_eval(
    config: Config, run: RunDir, task: Task | None = None, decoders: dict[str, DecoderFactory] = DECODERS
) -> None:
    task = task or make_task(config.task, config.seed)
    check_decoder_names(config.eval.decoders, decoders)
    check_decoder_names(config.eval.tuned_decoders, decoders)
    init_distributed()
    ensure_base(config, run)
    out = run.eval
    checkpoints = available_checkpoints(config, run)
    report_path = out / "report.json"
    report_fingerprint = eval_fingerprint(config, task, checkpoints)
    if report_path.exists() and read_json(report_path).get("fingerprint") == report_fingerprint:
        print0(f"eval: complete ({report_path}), skipping. Delete it to evaluate again.")
        return
    out.mkdir(parents=True, exist_ok=True)
    if rank() == 0:
        atomic_write_text(out / "config.yaml", config_to_yaml(config))
    rows, diagnostics = [], {}
    for checkpoint, path in checkpoints.items():
        records = evaluate_checkpoint(config, run, task, decoders, checkpoint, path)
        if rank() != 0:
            continue  # rank 0 writes the report
        for decoder, recs in records.items():
            rows.append(summarize(checkpoint, decoder, recs, greedy=records.get("greedy")))
            found = reflection_diagnostics(recs)
            if found is not None:
                diagnostics[f"{checkpoint}/{decoder}"] = found
    if rank() != 0:
        return
    report = {"fingerprint": report_fingerprint, "task": task.name, "split": config.eval.split,
              "checkpoints": {k: str(v) for k, v in checkpoints.items()}, "rows": rows, "diagnostics": diagnostics,
              "peak_rss_mb": peak_rss_mb()}
    atomic_write_text(out / "report.md", report_markdown(report))
    plot_accuracy_vs_fpe(rows, out / "accuracy_vs_fpe.png")
    atomic_write_json(report_path, report)  # last: its presence means the stage is complete
    for row in rows:
        log_metrics(run, "eval", **{k: v for k, v in row.items() if isinstance(v, (int, float, str))})
    print0(report_markdown(report))


def available_checkpoints(config: Config, run: RunDir) -> dict[str, Path]:
    found = {}
    for name in config.eval.checkpoints:
        path = model_path(config.model.path, run) if name == "base" else run.train / "merged"
        if name == "tuned" and not (path / "config.json").is_file():
            print0(f"eval: no tuned checkpoint at {path} (run `redumix train` first); evaluating the others")
            continue
        found[name] = path
    return found


def evaluate_checkpoint(
    config: Config, run: RunDir, task: Task, decoders: dict[str, DecoderFactory], checkpoint: str, path: Path
) -> dict[str, list[dict]]:
    """Every listed decoder on one checkpoint, in order; a decoder may be built from the records before it."""
    model, tokenizer = load_model(path, config.model.dtype, config.model.device, config.model.trust_remote_code,
                                  config.model.compile_decoding)
    model_id = model_identity(path)
    examples = task.examples(config.eval.split, max(config.eval.n, config.eval.n_other))
    results: dict[str, list[dict]] = {}
    for name in decoders_for(config, checkpoint):
        decoder = decoders[name.partition("@")[0]](config, name, results)
        identity = f"{model_id}:{fingerprint(decoder)}:{task_fingerprint(config, task)}"
        count = config.eval.n if name == "greedy" else config.eval.n_other
        path = records_path(run.eval / "generations", checkpoint, name)
        # Each rank scores every world_size-th example into its own part file; rank 0 gathers them in order.
        wanted = examples[:count]
        mine = wanted
        if world_size() > 1:
            gathered = {r["id"] for r in read_records(path) if r.get("model") == identity}
            mine = [e for e in wanted[rank() :: world_size()] if e.id not in gathered]
        score_resumable(
            path if world_size() == 1 else rank_part(path, rank()),
            identity,
            mine,
            lambda batch, decoder=decoder: decoder(model, tokenizer, batch, task),
            lambda example, out, seconds, name=name, identity=identity: make_record(
                example, out, task, name, checkpoint, identity, seconds
            ),
            config.eval.batch_size,
            desc=f"eval {checkpoint}/{name}" + (f" [rank {rank()}]" if world_size() > 1 else ""),
        )
        if world_size() > 1:
            barrier()
            if rank() == 0:
                gather_parts(path, identity, wanted, world_size())
            barrier()
        by_id = {r["id"]: r for r in read_records(path) if r.get("model") == identity}
        results[name] = [by_id[e.id] for e in wanted]
    return results


def rank_part(path: Path, index: int) -> Path:
    return path.with_name(f"{path.stem}.rank{index}{path.suffix}")


def gather_parts(path: Path, identity: str, examples: list, ranks: int) -> None:
    """The records already in `path` plus every rank's part, in example order, into `path`; then the parts go."""
    found = {r["id"]: r for r in read_records(path) if r.get("model") == identity}
    parts = [rank_part(path, index) for index in range(ranks)]
    for part in parts:
        found.update({r["id"]: r for r in read_records(part) if r.get("model") == identity})
    missing = [e.id for e in examples if e.id not in found]
    if missing:
        raise RuntimeError(f"eval: {path.name}: no record of {len(missing)} examples after every rank finished "
                           f"(e.g. {missing[:3]}); rerun the eval")
    atomic_write_bytes(path, "".join(json.dumps(found[e.id]) + "\n" for e in examples).encode())
    for part in parts:
        part.unlink(missing_ok=True)


def decoders_for(config: Config, checkpoint: str) -> list[str]:
    return config.eval.tuned_decoders if checkpoint == "tuned" and config.eval.tuned_decoders else config.eval.decoders


# --- fingerprints -------------------------------------------------------------------------------------------------


def task_fingerprint(config: Config, task: Task) -> str:
    """Which task and which problems: a record made for another task or seed is not reused."""
    decisive = {"task": task.name, "settings": dataclasses.asdict(config.task), "seed": config.seed}
    return hashlib.sha256(json.dumps(decisive, sort_keys=True).encode()).hexdigest()[:12]


def eval_fingerprint(config: Config, task: Task, checkpoints: dict[str, Path]) -> str:
    """Decides whether a finished report still stands: the whole resolved config (not its name) and the models.

    A setting that changes no record costs only a rebuild of the report from the stored records.
    """
    settings = {k: v for k, v in dataclasses.asdict(config).items() if k != "name"}
    models = {k: model_identity(v) for k, v in checkpoints.items()}
    decisive = {"config": settings, "task": task.name, "models": models}
    return hashlib.sha256(json.dumps(decisive, sort_keys=True).encode()).hexdigest()[:16]
