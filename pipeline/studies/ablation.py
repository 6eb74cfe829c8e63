"""`redumix ablation`: which ingredient of the round policy carries the gain of `redumix rounds`.

Every arm runs `rounds.count` rounds from the same starting model, in RUN_DIR/ablation/<arm>/seed-<s>/ (a rounds run
folder of its own, resumable as `redumix rounds` is):
- `policy`: the recipe's round policy, with every seed of `rounds.ablation_seeds` (the trainer's seed);
- `without-<key>`: one arm per ingredient, that is per key of OLD_POLICY where the recipe's policy differs, with
  that key set back to the old policy's value and every other ingredient kept;
- `old-policy`: OLD_POLICY, what `redumix rounds` did before round policies (replace the rows, train the last
  model, learn the redo alone);
- `old-policy-equal-steps`: the old policy again, each round trained for the policy's mean steps per round (its
  first seed), so that the total steps match and a gain is not more steps alone.
The arms other than `policy` train with the first seed. Round 1 harvests the same problems with the same starting
model in every arm, so its harvest is made once and copied to the others (the fingerprint check still applies).
`ablation.json` and `ablation.md` in RUN_DIR/ablation/ are rewritten after every arm; an arm not yet run is listed
as such, so the table can be read while the arms run.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path
from typing import Any

from redumix.common.files import atomic_write_json, atomic_write_text, read_json
from redumix.common.ranks import print0
from redumix.data.tasks import make_task
from redumix.pipeline.config import Config
from redumix.pipeline.decoders import BASELINE
from redumix.pipeline.embedded_stage import ensure_embedded
from redumix.pipeline.harvest_folder import harvest_record, made_with
from redumix.pipeline.records import read_records, records_path
from redumix.pipeline.report import paired_with_greedy
from redumix.pipeline.resolve import config_to_yaml
from redumix.pipeline.run import RunDir, arm_dir, model_path
from redumix.pipeline.studies.rounds import round_config, round_dir, run_rounds

# The round policy that stalled (docs/rounds.md): each key's value there. The recipe's policy differs from it in its
# ingredients.
OLD_POLICY: dict[str, Any] = {
    "train.skill_rows": False,
    "train.replay": 0.0,
    "rounds.accumulate": False,
    "rounds.restart": "last",
    "rounds.harvester": "last",
}


def setting(config: Config, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(config, section), key)


def with_settings(config: Config, changes: dict[str, Any]) -> Config:
    for dotted, value in changes.items():
        section, key = dotted.split(".")
        changed = dataclasses.replace(getattr(config, section), **{key: value})
        config = dataclasses.replace(config, **{section: changed})
    return config


def ablation_arms(config: Config) -> list[tuple[str, dict[str, Any], int]]:
    """(arm, the settings it changes, seed), in the order they run: the policy's first seed, each ingredient off, the
    old policy twice, then the policy's other seeds."""
    seeds = config.rounds.ablation_seeds
    ingredients = {k: v for k, v in OLD_POLICY.items() if setting(config, k) != v}
    arms = [("policy", {}, seeds[0])]
    arms += [(f"without-{k.split('.')[1].replace('_', '-')}", {k: v}, seeds[0]) for k, v in ingredients.items()]
    arms += [("old-policy", dict(OLD_POLICY), seeds[0]), ("old-policy-equal-steps", dict(OLD_POLICY), seeds[0])]
    arms += [("policy", {}, seed) for seed in seeds[1:]]
    return arms


def run_ablation(config: Config, run: RunDir) -> dict[str, Any]:
    ensure_embedded(config, run)
    start = model_path(config.model.path, run).resolve()
    arms = ablation_arms(config)
    for arm, changes, seed in arms:
        here = arm_dir(run.ablation, arm, seed)
        settings = with_settings(config, {**changes, "model.path": str(start), "train.seed": seed})
        if arm == "old-policy-equal-steps":
            settings = with_settings(settings, {"train.max_steps": policy_steps_per_round(run, config)})
        print0(f"ablation: arm {arm}, seed {seed} in {here.root}")
        here.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(here.config, config_to_yaml(settings))
        share_first_harvest(run, settings, here)
        run_rounds(settings, here)
        write_ablation(run, summarize_ablation(config, run, arms))
    return read_json(run.ablation / "ablation.json")


def policy_steps_per_round(run: RunDir, config: Config) -> int:
    """The policy arm's (first seed's) mean training steps per round."""
    first = arm_dir(run.ablation, "policy", config.rounds.ablation_seeds[0])
    steps = [read_json(round_dir(first, i).train / "metrics.json")["steps"] for i in range(1, config.rounds.count + 1)]
    return math.ceil(sum(steps) / len(steps))


def share_first_harvest(run: RunDir, settings: Config, here: RunDir) -> None:
    """Copy round 1's harvest from an arm that made it with the same record, if this arm has none yet."""
    target = round_dir(here, 1).harvest
    if target.exists():
        return
    first = round_config(settings, 1, Path(settings.model.path))
    record = harvest_record(first, make_task(first.task, first.seed))
    for source in sorted(run.ablation.glob("*/seed-*/rounds/round-1/harvest")):
        if made_with(source, record):
            print0(f"ablation: round 1's harvest is {source}'s (the same settings and starting model); copied")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(source, target.with_name("harvest.copying"), dirs_exist_ok=True)
            target.with_name("harvest.copying").rename(target)
            return


# --- the summary ------------------------------------------------------------------------------------------------


def _greedy(here: RunDir, index: int) -> list[dict]:
    return read_records(records_path(round_dir(here, index).eval / "generations", "tuned", BASELINE))


def arm_wall_seconds(here: RunDir, count: int) -> float:
    """Harvest decoding, training and eval decoding of every round (what the arm cost, without model loading)."""
    total = 0.0
    for index in range(1, count + 1):
        folder = round_dir(here, index)
        total += read_json(folder.harvest / "manifest.json").get("decode_seconds") or 0.0
        total += read_json(folder.train / "metrics.json")["wall_seconds"]
        total += sum(row["wall_s"] for row in read_json(folder.eval / "report.json")["rows"])
    return round(total, 1)


def summarize_ablation(config: Config, run: RunDir, arms: list[tuple[str, dict[str, Any], int]]) -> dict[str, Any]:
    count = config.rounds.count
    reference = arm_dir(run.ablation, "policy", config.rounds.ablation_seeds[0])
    rows = []
    for arm, changes, seed in arms:
        here = arm_dir(run.ablation, arm, seed)
        summary_path = here.root / "rounds" / "rounds.json"
        done = summary_path.is_file() and len(read_json(summary_path)["rounds"]) == count + 1
        row: dict[str, Any] = {"arm": arm, "seed": seed, "changes": changes, "done": done}
        if done:
            rounds = read_json(summary_path)["rounds"]
            row["rounds"] = [{d: r[d]["accuracy"] for d in config.rounds.decoders} for r in rounds]
            row["lost"] = sorted({d for r in rounds[1:] for d in r["lost"]})
            row["greedy_rises"] = all(r.get("improved") for r in rounds[1:])
            row["steps"] = sum(r["train"]["steps"] for r in rounds[1:])
            row["wall_seconds"] = arm_wall_seconds(here, count)
            if (arm, seed) != ("policy", config.rounds.ablation_seeds[0]) and (reference.root / "rounds" /
                                                                                "rounds.json").is_file():
                change = paired_with_greedy(_greedy(here, count), _greedy(reference, count))
                row["greedy_vs_policy"] = {"change": change["vs_greedy"], "low": change["vs_greedy_low"],
                                           "high": change["vs_greedy_high"]} if change else None
        rows.append(row)
    return {"decoders": list(config.rounds.decoders), "count": count, "arms": rows}


def write_ablation(run: RunDir, summary: dict[str, Any]) -> None:
    folder = run.ablation
    atomic_write_json(folder / "ablation.json", summary)
    atomic_write_text(folder / "ablation.md", ablation_markdown(summary))


def ablation_markdown(summary: dict[str, Any]) -> str:
    decoders, count = summary["decoders"], summary["count"]
    others = [d for d in decoders if d != BASELINE]
    head = ["arm", "seed", *[f"greedy r{i}" for i in range(count + 1)], f"round {count} greedy − policy's [95% CI]",
            *[f"{d} r{count}" for d in others], "lost (any round)", "greedy rises every round", "steps", "wall s"]
    lines = ["# Round-policy ablation", "",
             f"{count} rounds per arm. r0 is the starting model. Changes against the policy's first seed are paired "
             f"on the same test problems (round {count}'s greedy).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in summary["arms"]:
        cells = [row["arm"], str(row["seed"])]
        if not row["done"]:
            lines.append("| " + " | ".join(cells + ["not run yet"] + [""] * (len(head) - 3)) + " |")
            continue
        cells += [f"{r['greedy']:.1%}" for r in row["rounds"]]
        change = row.get("greedy_vs_policy")
        cells.append(f"{change['change'] * 100:+.1f} [{change['low'] * 100:+.1f}, {change['high'] * 100:+.1f}]"
                     if change else "–")
        cells += [f"{row['rounds'][-1][d]:.1%}" for d in others]
        cells += [", ".join(row["lost"]) or "none", "yes" if row["greedy_rises"] else "**no**", str(row["steps"]),
                  f"{row['wall_seconds']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
