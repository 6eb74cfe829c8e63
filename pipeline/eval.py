"""`redumix eval`: rerun the decoders on the base and tuned checkpoints over held-out problems, and report what
each decoder buys (accuracy, with a 95% Wilson interval) and what it costs (tokens, FPE, wall time).

Decoders, by name in `eval.decoders`: the `DECODERS` table of pipeline/decoders.py, one line a decoder (greedy,
sample, longhand, ReDuMix with verifier or self feedback and `@λ`, MoI, CNTP, vote@N, PDR, SR, Reflective Decoding
and its matched ablations, which follow the gated `reflective` run; Speculative Thinking with a guide model, the
guide's greedy and the random-handover ablation, which are run only when listed).

A decoder or a task defined elsewhere (a test, a notebook) goes in through `run_eval(config, run, task=...,
decoders={**DECODERS, "name": DecoderEntry(...)})`, with no edit here.

With both checkpoints, `tuned_vs_base` in report.json (a table in report.md) pairs each decoder on the tuned model
with itself on the base one: what training bought, with its interval.

Resume: each (checkpoint, decoder) keeps its per-example records in `eval/generations/` (pipeline/records.py),
rewritten atomically after every batch. A rerun skips the examples already scored. `report.json` is written last.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from redumix.common.files import atomic_write_json, atomic_write_jsonl, atomic_write_text, log_metrics, read_json
from redumix.common.fingerprints import fingerprint as fingerprint_of
from redumix.common.ranks import barrier, init_distributed, peak_rss_mb, print0, rank, world_size
from redumix.data.task import Task, grader_of
from redumix.data.tasks import make_task
from redumix.generate.decoder import fingerprint
from redumix.generate.engine import Engine
from redumix.pipeline.config import Config
from redumix.pipeline.decoders import BASELINE, DECODERS, DecoderEntry, check_decoder_names, family, make_decoder
from redumix.pipeline.embedded_stage import ensure_embedded
from redumix.pipeline.engines import HF, check_engine, open_engine
from redumix.pipeline.lineage import file_id, harvest_id, model_id
from redumix.pipeline.plot import plot_accuracy_vs_fpe
from redumix.pipeline.preflight import check_inputs
from redumix.pipeline.records import make_record, record_identity, records_for, records_path, score_resumable
from redumix.pipeline.report import (
    blind_replies,
    reflection_diagnostics,
    report_markdown,
    summarize,
    tuned_vs_base,
)
from redumix.pipeline.resolve import config_to_yaml
from redumix.pipeline.run import RunDir, model_path

# --- the stage ----------------------------------------------------------------------------------------------------


def run_eval(
    config: Config, run: RunDir, task: Task | None = None, decoders: dict[str, DecoderEntry] = DECODERS
) -> None:
    task = task or make_task(config.task, config.seed)
    check_decoder_names(config.eval.decoders, decoders)
    check_decoder_names(config.eval.tuned_decoders, decoders)
    init_distributed()
    ensure_embedded(config, run)
    out = run.eval
    checkpoints = available_checkpoints(config, run)
    report_path, plot_path = out / "report.json", out / "accuracy_vs_fpe.png"
    report_fingerprint = eval_fingerprint(config, task, checkpoints)
    if report_path.exists() and (done := read_json(report_path)).get("fingerprint") == report_fingerprint:
        if rank() == 0 and not newer(plot_path, report_path):  # the last run stopped between report and plot
            draw_plot(done["rows"], plot_path)
        print0(f"eval: complete ({report_path}), skipping. Delete it to evaluate again.")
        return
    examples = task.examples(config.eval.split, max(config.eval.n, config.eval.n_other))
    for path in checkpoints.values():  # before eval/ is written to
        check_inputs(config.model, path, examples, config.sampling.max_new_tokens)
    if check_engine(config, run)[1] != world_size():
        # eval gives each rank its own examples, and the ranks of a tensor-parallel engine must decode the same ones.
        raise ValueError(f"eval takes one engine per rank: set vllm.tensor_parallel_size=1 (NPROC=N gives N engines); "
                         f"tensor parallelism is for the harvest (engine={config.engine})")
    out.mkdir(parents=True, exist_ok=True)
    if rank() == 0:
        atomic_write_text(out / "config.yaml", config_to_yaml(config))
    rows, diagnostics, every_record = [], {}, {}
    for checkpoint, path in checkpoints.items():
        records = evaluate_checkpoint(config, run, task, decoders, checkpoint, path)
        if rank() != 0:
            continue  # rank 0 writes the report
        every_record[checkpoint] = records
        for decoder, recs in records.items():
            rows.append(summarize(checkpoint, decoder, recs, greedy=records.get(BASELINE),
                                  details=decoders[family(decoder)].details))
            found = reflection_diagnostics(recs)
            if found is not None:
                diagnostics[f"{checkpoint}/{decoder}"] = found
    if rank() != 0:
        return
    report = {"fingerprint": report_fingerprint, "task": task.name, "split": config.eval.split,
              "checkpoints": {k: str(v) for k, v in checkpoints.items()},
              # which harvest and train output the tuned model came from, and each checkpoint's weights
              "inputs": {"harvest": harvest_id(run.harvest), "train": file_id(run.train / "metrics.json"),
                         "models": {k: model_id(v) for k, v in checkpoints.items()}},
              "rows": rows, "tuned_vs_base": tuned_vs_base(every_record, base=config.eval.base_label),
              "blind_replies": blind_replies(task, examples[: config.eval.n]),  # greedy's examples, no model call
              "diagnostics": diagnostics, "peak_rss_mb": peak_rss_mb(),
              "grader": grader_of(task)}  # what ran the model's code
    # The report first, whole (report.json, the completion marker, after its Markdown), then the plot drawn from it:
    # a plot that fails is a warning, and a rerun after a stop between the two draws the plot (missing, or older
    # than the report).
    atomic_write_text(out / "report.md", report_markdown(report, decoders))
    atomic_write_json(report_path, report)
    draw_plot(rows, plot_path)
    for row in rows:
        log_metrics(run.metrics, "eval", **{k: v for k, v in row.items() if isinstance(v, (int, float, str))})
    print0(report_markdown(report, decoders))


def draw_plot(rows: list[dict], path: Path) -> None:
    """The accuracy-against-FPE plot of report rows. It comes after the report, which it never stops: a failure to
    draw or write it is a warning."""
    try:
        plot_accuracy_vs_fpe(rows, path)
    except Exception as exc:  # matplotlib and the file system raise many kinds; the report is already whole
        print0(f"eval: warning: the plot {path} was not drawn ({type(exc).__name__}: {exc}); the report is complete, "
               "and the next `redumix eval` draws the plot again")


def newer(path: Path, than: Path) -> bool:
    """Whether `path` exists and was written no earlier than `than`."""
    return path.is_file() and path.stat().st_mtime_ns >= than.stat().st_mtime_ns


def available_checkpoints(config: Config, run: RunDir) -> dict[str, Path]:
    found = {}
    for name in config.eval.checkpoints:
        path = model_path(config.model.path, run) if name == "base" else run.train / "merged"
        if name == "tuned" and not (path / "config.json").is_file():
            print0(f"eval: no tuned checkpoint at {path} (run `redumix train` first); evaluating the others")
            continue
        found[config.eval.base_label if name == "base" else name] = path
    return found


def evaluate_checkpoint(
    config: Config, run: RunDir, task: Task, decoders: dict[str, DecoderEntry], checkpoint: str, path: Path
) -> dict[str, list[dict]]:
    """Every listed decoder on one checkpoint, in order; a decoder may be built from the records before it."""
    engines: dict[str, Engine] = {}

    def engine_named(name: str) -> Engine:
        """The engine, loaded when a decoder first has examples to decode: a resumed eval whose records are all
        written loads nothing."""
        if name not in engines:
            engines[name] = open_engine(config, path, name)
        return engines[name]

    if world_size() > 1:  # every rank loads at once: vLLM's engine build is a collective over the ranks
        engine_named(config.engine)
    weights = model_id(path)
    examples = task.examples(config.eval.split, max(config.eval.n, config.eval.n_other))
    results: dict[str, list[dict]] = {}
    for name in decoders_for(config, checkpoint):
        decoder = make_decoder(config, name, results, decoders)
        engine = HF if decoder.needs_hf_engine else config.engine
        if engine != config.engine:
            print0(f"eval: {name} needs the cache token by token, so it runs on the {HF!r} engine")
        # The engine is part of a record's identity (HF's records, the first, carry none): the two engines' replies
        # differ at bf16 near ties, so records of one are not resumed as the other's.
        identity = record_identity(weights, fingerprint(decoder), engine)
        count = config.eval.n if name == BASELINE else config.eval.n_other
        records = records_path(run.eval / "generations", checkpoint, name)
        # Each rank scores every world_size-th example into its own part file; rank 0 gathers them in order.
        wanted = examples[:count]
        mine = wanted
        if world_size() > 1:
            gathered = records_for(records, identity, wanted)
            mine = [e for e in wanted[rank() :: world_size()] if e.id not in gathered]
        score_resumable(
            records if world_size() == 1 else rank_part(records, rank()),
            identity,
            mine,
            lambda batch, decoder=decoder, engine=engine: decoder(engine_named(engine), batch, task),
            lambda example, out, seconds, name=name, identity=identity: make_record(
                example, out, task, name, checkpoint, identity, seconds
            ),
            config.eval.batch_size,
            desc=f"eval {checkpoint}/{name}" + (f" [rank {rank()}]" if world_size() > 1 else ""),
        )
        if world_size() > 1:
            barrier()
            if rank() == 0:
                gather_parts(records, identity, wanted, world_size())
            barrier()
        by_id = records_for(records, identity, wanted)
        results[name] = [by_id[e.id] for e in wanted]
    for opened in engines.values():
        opened.close()
    return results


def rank_part(path: Path, index: int) -> Path:
    return path.with_name(f"{path.stem}.rank{index}{path.suffix}")


def gather_parts(path: Path, identity: str, examples: list, ranks: int) -> None:
    """The records already in `path` plus every rank's part, in example order, into `path`; then the parts go."""
    found = records_for(path, identity, examples)
    parts = [rank_part(path, index) for index in range(ranks)]
    for part in parts:
        found.update(records_for(part, identity, examples))
    missing = [e.id for e in examples if e.id not in found]
    if missing:
        raise RuntimeError(f"eval: {path.name}: no record of {len(missing)} examples after every rank finished "
                           f"(e.g. {missing[:3]}); rerun the eval")
    atomic_write_jsonl(path, [found[e.id] for e in examples])
    for part in parts:
        part.unlink(missing_ok=True)


def decoders_for(config: Config, checkpoint: str) -> list[str]:
    return config.eval.tuned_decoders if checkpoint == "tuned" and config.eval.tuned_decoders else config.eval.decoders


# --- fingerprints -------------------------------------------------------------------------------------------------


def eval_fingerprint(config: Config, task: Task, checkpoints: dict[str, Path]) -> str:
    """Decides whether a finished report still stands: the whole resolved config (not its name) and the models.

    A setting that changes no record costs only a rebuild of the report from the stored records, so this hash may
    follow the config's layout: a rename rebuilds the report once, and decodes nothing.
    """
    settings = {k: v for k, v in dataclasses.asdict(config).items() if k != "name"}
    models = {k: model_id(v) for k, v in checkpoints.items()}
    return fingerprint_of({"config": settings, "task": task.name, "models": models})
