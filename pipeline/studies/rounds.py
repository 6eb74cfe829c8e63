"""`redumix rounds`: harvest -> train -> eval, round after round; round r+1 starts from round r's tuned model.

RUN_DIR/rounds/round-R/ is a run folder of its own (harvest/, train/, eval/, logs/, config.yaml):
- round 1 starts from `model.path` (the embedded base by default, built or copied into RUN_DIR/embedded first);
  round R+1 harvests from, and trains, round R's `train/merged`;
- round R harvests the train split's problems [(R-1)·n, R·n) (`harvest.skip`), so no round relearns the rows an
  earlier round trained on;
- eval runs `rounds.decoders` on the round's tuned model, and round 1 also on the starting model (round 0).

Each stage resumes as it does alone, so a rerun after a crash continues where it stopped and skips what is done.
After every round, `rounds.json`, `rounds.md` and `rounds.png` show every decoder of `rounds.decoders` on each
round's model with 95% intervals and its paired change from the round before and from round 0, the harvest's fixed
and broken, the rows, steps and seconds of training, and the drift KL(round ‖ round 0) on the round's own greedy
answers. A round whose greedy does not improve, or that loses a decoder's accuracy, is flagged.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from redumix.common.files import atomic_write_json, atomic_write_text, read_json, read_json_or_none
from redumix.common.ranks import print0, rank
from redumix.pipeline.config import Config
from redumix.pipeline.decoders import BASELINE, DECODERS, check_decoder_names, family
from redumix.pipeline.embedded_stage import ensure_embedded
from redumix.pipeline.eval import run_eval
from redumix.pipeline.harvest import run_harvest
from redumix.pipeline.records import read_records, records_path
from redumix.pipeline.report import paired_with_greedy, summarize
from redumix.pipeline.resolve import config_to_yaml
from redumix.pipeline.run import RunDir, model_path
from redumix.pipeline.studies.drift import drift_kl
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
    ensure_embedded(config, run)
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
            measure_drift(config, here, first)
            summary = summarize_rounds(config, run, index)
            write_summary(run, summary)
        last = (here.train / "merged").resolve()
    return read_json(run.root / "rounds" / "rounds.json") if rank() == 0 else {}


# --- the summary ------------------------------------------------------------------------------------------------


def _records(run: RunDir, checkpoint: str, decoder: str) -> list[dict]:
    return read_records(records_path(run.eval / "generations", checkpoint, decoder))


def _paired(records: list[dict], before: list[dict]) -> dict[str, Any] | None:
    """This round's records against an earlier model's on the same problems: change, 95% interval, fixed, broken."""
    change = paired_with_greedy(records, before)
    if not change:
        return None
    return {"change": change["vs_greedy"], "low": change["vs_greedy_low"], "high": change["vs_greedy_high"],
            "fixed": change["vs_greedy_fixed"], "broken": change["vs_greedy_broken"], "mcnemar_p": change["mcnemar_p"]}


def measure_drift(config: Config, here: RunDir, start: Path) -> dict[str, Any]:
    """KL(round ‖ start) per token on the round's own greedy answers to `evidence.drift_n` test prompts, once."""
    path = here.root / "drift.json"
    if not path.is_file():
        records = _records(here, "tuned", BASELINE)[: config.evidence.drift_n]
        kl = drift_kl(config, here.train / "merged", start, records)
        atomic_write_json(path, {"kl_round_start": kl, "prompts": len(records)})
    return read_json(path)


def summarize_rounds(config: Config, run: RunDir, done: int) -> dict[str, Any]:
    """Round 0 (the starting model) and rounds 1..done: every decoder's accuracy, its paired change from the round
    before and from round 0, the harvest's fixed and broken, the training's rows, steps and time, the drift from the
    starting model, and the decoders the round lost (a paired interval wholly below zero)."""
    decoders = list(config.rounds.decoders)
    rounds: list[dict[str, Any]] = []
    start: dict[str, list[dict]] = {}
    previous: dict[str, list[dict]] = {}
    for index in range(0, done + 1):
        here = round_dir(run, max(index, 1))
        checkpoint = "base" if index == 0 else "tuned"
        row: dict[str, Any] = {"round": index, "model": str(read_json(here.eval / "report.json")["checkpoints"][
            checkpoint])}
        records = {decoder: _records(here, checkpoint, decoder) for decoder in decoders}
        for decoder, recs in records.items():
            summary = summarize(checkpoint, decoder, recs, details=DECODERS[family(decoder)].details)
            row[decoder] = {k: summary[k] for k in ("accuracy", "n", "ci_low", "ci_high", "mean_tokens", "mean_fpe")}
            if index > 0:
                row[decoder]["vs_previous"] = _paired(recs, previous[decoder])
                row[decoder]["vs_start"] = _paired(recs, start[decoder])
        if index > 0:
            row["lost"] = [d for d in decoders if any(c and c["high"] < 0 for c in (row[d]["vs_previous"],
                                                                                     row[d]["vs_start"]))]
            if BASELINE in records and row[BASELINE]["vs_previous"]:
                row["improved"] = row[BASELINE]["vs_previous"]["low"] > 0
            trained = read_json(here.train / "metrics.json")
            harvested = read_json(here.harvest / "manifest.json")
            row["heldout_kl"] = {"before": trained["heldout_kl_base"], "after": trained["heldout_kl_merged"],
                                 "note": trained.get("heldout_note")}  # why they are null, when they are
            row["harvest"] = {k: harvested.get(k) for k in ("rows", "skip", "original_accuracy", "redo_accuracy",
                                                            "fixed", "broken", "decode_seconds")}
            row["train"] = {"rows": trained.get("rows"), "steps": trained["steps"],
                            "wall_seconds": trained["wall_seconds"]}
            drift = read_json_or_none(here.root / "drift.json")
            row["drift_kl"] = drift["kl_round_start"] if drift else None
        else:
            start = records
        previous = records
        rounds.append(row)
    return {"decoders": decoders, "rounds": rounds}


def write_summary(run: RunDir, summary: dict[str, Any]) -> None:
    folder = run.root / "rounds"
    atomic_write_json(folder / "rounds.json", summary)
    atomic_write_text(folder / "rounds.md", rounds_markdown(summary))
    plot_rounds(summary, folder / "rounds.png")


def _points(change: dict[str, Any] | None) -> str:
    if not change:
        return "–"
    return f"{change['change'] * 100:+.1f} [{change['low'] * 100:+.1f}, {change['high'] * 100:+.1f}]"


def rounds_markdown(summary: dict[str, Any]) -> str:
    decoders = summary["decoders"]
    lines = ["# Rounds", "", "Round 0 is the starting model; round r is the model round r trained. Each cell: "
             "accuracy [95% Wilson interval] (n); below it, the paired change in points from the round before "
             "[95% interval] (fixed / broken). A decoder is **lost** when its paired change from the round before "
             "or from round 0 lies wholly below zero.", ""]
    head = ["round", *decoders, "greedy verdict"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in summary["rounds"]:
        cells = [str(row["round"])]
        for decoder in decoders:
            d = row[decoder]
            cell = f"{d['accuracy']:.1%} [{d['ci_low']:.1%}–{d['ci_high']:.1%}] ({d['n']})"
            change = d.get("vs_previous")
            if change:
                cell += f"<br>{_points(change)} ({change['fixed']} / {change['broken']})"
            if decoder in row.get("lost", []):
                cell += " **lost**"
            cells.append(cell)
        if "improved" in row:
            cells.append("improved" if row["improved"] else "**did not improve**")
        else:
            cells.append("–")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| round | harvest original → redo (fixed / broken) | rows learnt | steps | train s | "
              "held-out KL before → after | drift KL(round ‖ round 0) | greedy tokens/answer | lost |",
              "|---|---|---|---|---|---|---|---|---|"]
    for row in summary["rounds"][1:]:
        h, t, kl = row["harvest"], row["train"], row["heldout_kl"]
        harvest = (f"{h['original_accuracy']:.1%} → {h['redo_accuracy']:.1%} ({h['fixed']} / {h['broken']})"
                   if h.get("original_accuracy") is not None else "–")
        rows = ", ".join(f"{k} {v}" for k, v in (t["rows"] or {}).items() if k not in ("harvested", "selected"))
        drift = f"{row['drift_kl']:.4f}" if row.get("drift_kl") is not None else "–"
        tokens = f"{row[BASELINE]['mean_tokens']:.1f}" if BASELINE in row else "–"
        lines.append(f"| {row['round']} | {harvest} | {rows} | {t['steps']} | {t['wall_seconds']:.0f} | "
                     f"{_kl_change(kl)} | {drift} | {tokens} | "
                     f"{', '.join(row['lost']) or 'none'} |")
    return "\n".join(lines) + "\n"


def _kl_change(kl: dict[str, Any]) -> str:
    if kl["before"] is None or kl["after"] is None:
        return f"undefined ({kl.get('note') or 'no held-out tokens'})"
    return f"{kl['before']:.4f} → {kl['after']:.4f}"


def plot_rounds(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = summary["rounds"]
    xs = [row["round"] for row in rounds]
    fig, (ax, drift) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [2, 1]})
    for decoder in summary["decoders"]:
        ys = [100 * row[decoder]["accuracy"] for row in rounds]
        low = [max(0.0, y - 100 * row[decoder]["ci_low"]) for y, row in zip(ys, rounds, strict=True)]  # never < 0
        high = [max(0.0, 100 * row[decoder]["ci_high"] - y) for y, row in zip(ys, rounds, strict=True)]
        ax.errorbar(xs, ys, yerr=[low, high], marker="o", capsize=3, label=f"{decoder} (n={rounds[0][decoder]['n']})")
        lost = [(row["round"], 100 * row[decoder]["accuracy"]) for row in rounds if decoder in row.get("lost", [])]
        if lost:
            ax.scatter(*zip(*lost, strict=True), s=120, facecolors="none", edgecolors="red", zorder=3)
    ax.set_title("accuracy per round (red ring: skill lost)")
    ax.set_xlabel("round (0 = starting model)")
    ax.set_ylabel("accuracy, % (95% Wilson interval)")
    ax.set_xticks(xs)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    drifts = [(row["round"], row["drift_kl"]) for row in rounds if row.get("drift_kl") is not None]
    if drifts:
        drift.plot(*zip(*drifts, strict=True), marker="o", color="gray")
    drift.set_title("drift KL(round ‖ round 0) per token")
    drift.set_xlabel("round")
    drift.set_xticks(xs)
    drift.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
