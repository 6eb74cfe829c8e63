"""The `rft` evidence arm's rows: the starting model's own right answers, k samples per problem (rejection sampling).

RFT (rejection-sampling fine-tuning, arXiv:2308.01825) is SFT on a model's own samples that a verifier passes: the
baseline a user tries first. With `evidence.rft_samples` k > 0, the starting model draws k independent samples per
harvested problem from x alone at `evidence.rft_temperature`. They are drawn with the ladder's seeds, so at the
redo's temperature (the default) they are the ladder's resamples, the same texts (pipeline/studies/ladder.py). The
verifier keeps the right ones, and the harvest's attempts where they are right. Each distinct kept text is one row: the
harvest row with `original` set to it, so the arm trains as every hard-label arm does (`train.target=original`,
`train.rows=original_correct`), and a problem's rows share its id and so its side of the held-out split. With
k = 0 the arm learns the right attempts alone, from the harvest itself.

RUN_DIR/evidence/harvest-rft/ holds samples.jsonl (every sample, graded, written after each batch: a rerun goes on
where it stopped, and a larger k adds samples) and harvest/, the rows as shards and a manifest, written once every
sample is in. The samples are decoded on the recipe's `engine`, on rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from redumix.common.files import atomic_write_bytes, atomic_write_json, atomic_write_jsonl, read_json, read_jsonl
from redumix.common.fingerprints import rft_record_v0
from redumix.common.ranks import barrier, print0, rank
from redumix.data.chat import batch_template_pieces
from redumix.data.prompts import attempt_messages
from redumix.data.shards import bad_shards, encode_shard, iter_rows, shard_name, shard_paths, shard_record
from redumix.data.tasks import make_task, task_record
from redumix.generate.policy import SamplingPolicy
from redumix.generate.redumix import redo_policy
from redumix.pipeline.config import Config
from redumix.pipeline.engines import open_engine
from redumix.pipeline.harvest_folder import claim_settings
from redumix.pipeline.lineage import harvest_id
from redumix.pipeline.studies.ladder import graded, reply_texts, resample_names, resample_seeds


def rft_harvest(config: Config, model: Path, harvest: Path, folder: Path) -> Path:
    """folder/harvest: the rows the `rft` arm learns, from `harvest`'s problems and `model`'s k samples of each."""
    k = config.evidence.rft_samples
    out = folder / "harvest"
    manifest_path = out / "manifest.json"
    source = harvest_id(harvest)
    if manifest_path.is_file():
        manifest = read_json(manifest_path)
        if (manifest.get("source"), manifest.get("rft_samples")) == (source, k) and not bad_shards(
                out, manifest["shard_files"]):
            return out
    if rank() == 0:
        rows = [r for r in iter_rows(shard_paths(harvest)) if r["original_correct"] is not None]
        samples = draw_samples(config, model, rows, folder)
        kept = kept_rows(rows, samples, resample_names(k))
        if not kept:
            raise ValueError(f"evidence: no problem of {harvest} has a right answer among its attempt and "
                             f"{k} samples, so the rft arm has nothing to learn; drop it from evidence.*_arms")
        problems = by_problem(rows)
        write_rows(out, kept, config.harvest.shard_rows, {
            "source": source, "rft_samples": k, "problems": len(problems),
            "problems_kept": len({r["id"] for r in kept}),
            # kept rows that are attempts: a problem's right attempts once per distinct text, as kept_rows keeps them
            "rows_from_attempts": sum(len({r["original"] for r in attempts if r["original_correct"]})
                                      for attempts in problems.values()),
            "rows": len(kept)})
        print0(f"evidence: rft rows in {out}: {len(kept)} right answers of {len({r['id'] for r in kept})} of "
               f"{len(problems)} problems (the attempts and {k} samples each)")
    barrier()
    return out


def draw_samples(config: Config, model: Path, rows: list[dict], folder: Path) -> dict[str, dict]:
    """{problem id: {resample name: graded sample}} for every row, drawn where samples.jsonl lacks them."""
    task = make_task(config.task, config.seed)
    h = config.harvest
    examples = {e.id: e for e in task.examples(h.split, h.skip + h.n)[h.skip :]}
    folder.mkdir(parents=True, exist_ok=True)
    claim_settings(folder / "settings.json", rft_record(config), "rft samples", f"delete {folder} to draw them again",
                   rft_record_v0)
    path = folder / "samples.jsonl"
    records = {r["id"]: r for _, r in read_jsonl(path)} if path.exists() else {}
    names = resample_names(config.evidence.rft_samples)
    problems = [attempts[0] for attempts in by_problem(rows).values()]
    todo = [r for r in problems if not set(names) <= set(records.get(r["id"], {}).get("samples", {}))]
    if todo:
        engine, policy = open_engine(config, model), rft_policy(config)
        bar = tqdm(total=len(todo), desc="evidence: rft samples", unit="problem")
        for start in range(0, len(todo), config.harvest.batch_size):
            batch = todo[start : start + config.harvest.batch_size]
            ids = [r["id"] for r in batch]
            conversations = [attempt_messages(r["prompt"]) for r in batch]
            x_ids = [pieces[0] for pieces in batch_template_pieces(engine.tokenizer, conversations)]
            for name in names:
                missing = [i for i, id_ in enumerate(ids) if name not in records.get(id_, {}).get("samples", {})]
                if not missing:
                    continue
                seeds = resample_seeds(config, ids, name)  # the ladder's
                gens = engine.sample([x_ids[i] for i in missing], [seeds[i] for i in missing], policy)
                for i, text in zip(missing, reply_texts(engine, gens), strict=True):
                    record = records.setdefault(ids[i], {"id": ids[i], "samples": {}})
                    record["samples"][name] = graded(task, text, examples[ids[i]])
            atomic_write_jsonl(path, records.values(), ensure_ascii=False)  # a crash loses one batch
            bar.update(len(batch))
        bar.close()
        engine.close()
    return {r["id"]: records[r["id"]]["samples"] for r in rows}


def kept_rows(rows: list[dict], samples: dict[str, dict], names: Sequence[str]) -> list[dict]:
    """One row per distinct right answer of each problem: its right attempt first, then its right samples."""
    kept = []
    for problem, attempts in by_problem(rows).items():  # a harvest with `harvest.attempts` > 1 has several rows
        texts = [row["original"] for row in attempts if row["original_correct"]]
        texts += [samples[problem][n]["text"] for n in names if samples[problem][n]["correct"]]
        kept += [attempts[0] | {"original": text, "original_correct": True} for text in dict.fromkeys(texts)]
    return kept


def by_problem(rows: list[dict]) -> dict[str, list[dict]]:
    """Each problem's rows, in order of first appearance."""
    problems: dict[str, list[dict]] = {}
    for row in rows:
        problems.setdefault(row["id"], []).append(row)
    return problems


def write_rows(out: Path, rows: list[dict], shard_rows: int, totals: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)  # the folder is complete again only when its manifest is
    for stale in shard_paths(out):
        stale.unlink()
    names = []
    for k, start in enumerate(range(0, len(rows), shard_rows)):
        names.append(shard_name(k))
        atomic_write_bytes(out / names[-1], encode_shard(rows[start : start + shard_rows]))
    atomic_write_json(out / "manifest.json", totals | {
        "shards": names, "shard_files": {name: shard_record(out / name) for name in names}})


def rft_policy(config: Config) -> SamplingPolicy:
    """The samples' policy: `sampling` at evidence.rft_temperature, by default the redo's."""
    temperature = config.evidence.rft_temperature
    policy = redo_policy(config.redumix, config.sampling)
    return policy if temperature is None else replace(policy, temperature=temperature)


def rft_record(config: Config) -> dict:
    """What fixes a sample, in the record's own names (common/fingerprints.py): the seed, the task, the model's path
    and dtype and the samples' policy. Not k, which only adds samples, nor the device, compile_decoding, the batch
    size or the engine, which change speed and float rounding only (as for a harvest)."""
    policy = rft_policy(config)
    return {"seed": config.seed, "task": task_record(config.task),
            "model": {"path": config.model.path, "dtype": config.model.dtype},
            "policy": {"temperature": policy.temperature, "top_p": policy.top_p, "top_k": policy.top_k,
                       "max_new_tokens": policy.max_new_tokens}}
