"""`redumix rounds`: harvest -> train -> eval, round after round; round r+1 starts from round r's tuned model.

RUN_DIR/rounds/round-R/ is a run folder of its own (harvest/, train/, eval/, logs/, config.yaml):
- round 1 starts from `model.path` (the embedded base by default, built or copied into RUN_DIR/base first);
  round R+1 harvests from, and trains, round R's `train/merged`;
- round R harvests the train split's problems [(R-1)·n, R·n) (`harvest.skip`), so no round relearns the rows an
  earlier round trained on;
- eval runs `rounds.decoders` on the round's tuned model, and round 1 also on the starting model (round 0).

Each stage resumes as it does alone, so a rerun after a crash continues where it stopped and skips what is done.
After every round, `rounds.json`, `rounds.md` and `rounds.png` show each round's greedy and ReDuMix accuracy with
95% intervals, greedy's paired change from the round before, tokens per answer and the held-out KL.
A round that does not improve is reported as one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from redumix.embedded.stage import ensure_base
from redumix.pipeline.config import Config
from redumix.pipeline.decoders import check_decoder_names
from redumix.pipeline.eval import run_eval
from redumix.pipeline.harvest import run_harvest
from redumix.pipeline.records import read_records, records_path
from redumix.pipeline.report import paired_with_greedy, summarize
from redumix.pipeline.resolve import config_to_yaml
from redumix.pipeline.run import RunDir, atomic_write_json, atomic_write_text, model_path, print0, rank, read_json
from redumix.pipeline.train import run_train


def round_dir(run: RunDir, index: int) -> RunDir:
    return RunDir(run.root / "rounds" / f"round-{index}")


def round_config(config: Config, index: int, start: Path) -> Config:
    """Round `index`'s settings: its starting model, its own slice of the train split, and the rounds' eval."""
    checkpoints = ["base", "tuned"] if index == 1 else ["tuned"]  # round r's start is round r-1's tuned model
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, path=str(start)),
        harvest=dataclasses.replace(config.harvest, skip=config.harvest.skip + (index - 1) * config.harvest.n),
        eval=dataclasses.replace(config.eval, decoders=list(config.rounds.decoders), tuned_decoders=[],
                                 checkpoints=checkpoints),
    )


def run_rounds(config: Config, run: RunDir) -> dict[str, Any]:
    """Each round harvests with `rounds.harvester`, trains `rounds.restart` on its rows (and, with
    `rounds.accumulate`, every earlier round's), and evaluates what it trained."""
    check_decoder_names(config.rounds.decoders)
    ensure_base(config, run)
    first = model_path(config.model.path, run).resolve()
    last = first  # the model the latest round produced
    for index in range(1, config.rounds.count + 1):
        here = round_dir(run, index)
        harvester = first if config.rounds.harvester == "start" else last
        trainee = first if config.rounds.restart == "start" else last
        print0(f"rounds: round {index} of {config.rounds.count} in {here.root}: {harvester} harvests, "
               f"{trainee} trains")
        settings = round_config(config, index, trainee)
        earlier = [str(round_dir(run, i).harvest) for i in range(1, index)] if config.rounds.accumulate else []
        settings = dataclasses.replace(settings, train=dataclasses.replace(settings.train, more_harvests=earlier))
        if rank() == 0:
            here.root.mkdir(parents=True, exist_ok=True)
            atomic_write_text(here.config, config_to_yaml(settings))
        harvest_settings = dataclasses.replace(settings, model=dataclasses.replace(settings.model,
                                                                                  path=str(harvester)))
        run_harvest(harvest_settings, here)
        run_train(settings, here)
        run_eval(settings, here)
        if rank() == 0:
            summary = summarize_rounds(config, run, index)
            write_summary(run, summary)
        last = (here.train / "merged").resolve()
    return read_json(run.root / "rounds" / "rounds.json") if rank() == 0 else {}


# --- the summary ------------------------------------------------------------------------------------------------


def _records(run: RunDir, checkpoint: str, decoder: str) -> list[dict]:
    return read_records(records_path(run.eval / "generations", checkpoint, decoder))


def summarize_rounds(config: Config, run: RunDir, done: int) -> dict[str, Any]:
    """Round 0 (the starting model) and rounds 1..done: accuracy per decoder, paired change, tokens, KL."""
    decoders = list(config.rounds.decoders)
    rounds: list[dict[str, Any]] = []
    previous: list[dict] | None = None
    for index in range(0, done + 1):
        here = round_dir(run, max(index, 1))
        checkpoint = "base" if index == 0 else "tuned"
        row: dict[str, Any] = {"round": index, "model": str(read_json(here.eval / "report.json")["checkpoints"][
            checkpoint])}
        records = {decoder: _records(here, checkpoint, decoder) for decoder in decoders}
        for decoder, recs in records.items():
            summary = summarize(checkpoint, decoder, recs)
            row[decoder] = {k: summary[k] for k in ("accuracy", "n", "ci_low", "ci_high", "mean_tokens", "mean_fpe")}
        greedy = records.get("greedy")
        if greedy and previous:
            change = paired_with_greedy(greedy, previous)
            row["greedy_vs_previous"] = {
                "change": change["vs_greedy"], "low": change["vs_greedy_low"], "high": change["vs_greedy_high"],
                "fixed": change["vs_greedy_fixed"], "broken": change["vs_greedy_broken"],
                "mcnemar_p": change["mcnemar_p"],
            }
            row["improved"] = change["vs_greedy_low"] > 0
        if index > 0:
            trained = read_json(here.train / "metrics.json")
            harvested = read_json(here.harvest / "manifest.json")
            row["heldout_kl"] = {"before": trained["heldout_kl_base"], "after": trained["heldout_kl_merged"]}
            row["harvest"] = {k: harvested.get(k) for k in ("rows", "skip", "original_accuracy", "redo_accuracy")}
        previous = greedy
        rounds.append(row)
    return {"decoders": decoders, "rounds": rounds}


def write_summary(run: RunDir, summary: dict[str, Any]) -> None:
    folder = run.root / "rounds"
    atomic_write_json(folder / "rounds.json", summary)
    atomic_write_text(folder / "rounds.md", rounds_markdown(summary))
    plot_rounds(summary, folder / "rounds.png")


def rounds_markdown(summary: dict[str, Any]) -> str:
    decoders = summary["decoders"]
    head = ["round", *[f"{d} accuracy [95% CI] (n)" for d in decoders], "greedy change vs the round before [95% CI]",
            "greedy tokens/answer", "held-out KL before → after", "harvest original → redo"]
    lines = ["# Rounds", "", "Round 0 is the starting model; round r is the model round r trained.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in summary["rounds"]:
        cells = [str(row["round"])]
        for decoder in decoders:
            d = row[decoder]
            cells.append(f"{d['accuracy']:.1%} [{d['ci_low']:.1%}–{d['ci_high']:.1%}] ({d['n']})")
        change = row.get("greedy_vs_previous")
        if change:
            verdict = "improved" if row["improved"] else "**did not improve**"
            cells.append(f"{change['change'] * 100:+.1f} pts [{change['low'] * 100:+.1f}, {change['high'] * 100:+.1f}]"
                         f" ({change['fixed']} fixed / {change['broken']} broken): {verdict}")
        else:
            cells.append("–")
        cells.append(f"{row['greedy']['mean_tokens']:.1f}" if "greedy" in row else "–")
        kl = row.get("heldout_kl")
        cells.append(f"{kl['before']:.4f} → {kl['after']:.4f}" if kl else "–")
        harvest = row.get("harvest")
        cells.append(f"{harvest['original_accuracy']:.1%} → {harvest['redo_accuracy']:.1%}"
                     if harvest and harvest.get("original_accuracy") is not None else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_rounds(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for decoder in summary["decoders"]:
        xs = [row["round"] for row in summary["rounds"]]
        ys = [row[decoder]["accuracy"] for row in summary["rounds"]]
        low = [y - row[decoder]["ci_low"] for y, row in zip(ys, summary["rounds"], strict=True)]
        high = [row[decoder]["ci_high"] - y for y, row in zip(ys, summary["rounds"], strict=True)]
        ax.errorbar(xs, ys, yerr=[low, high], marker="o", capsize=3, label=decoder)
    ax.set_xlabel("round (0 = starting model)")
    ax.set_ylabel("accuracy (95% Wilson interval)")
    ax.set_xticks([row["round"] for row in summary["rounds"]])
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
