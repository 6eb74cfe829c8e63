"""The evidence stage's summary: every arm's accuracy, paired changes and drift, pooled over seeds and paired with
the mixture arm on the same problems (`evidence.json`), its tables (`evidence.md`) and its plot (`evidence.png`).
pipeline/studies/evidence.py measures the arms; this file only reads what they wrote.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

from redumix.common.files import read_json
from redumix.pipeline.config import Config
from redumix.pipeline.decoders import BASELINE
from redumix.pipeline.records import read_records, records_path
from redumix.pipeline.run import RunDir, arm_dir
from redumix.pipeline.stats import mcnemar_exact_p, wilson_interval


def greedy_records(here: RunDir, checkpoint: str) -> list[dict]:
    return read_records(records_path(here.eval / "generations", checkpoint, BASELINE))


def recorded_place(records: Path, folder: Path, here: RunDir) -> Path:
    """Where a run folder under RUN_DIR/evidence keeps its grades in a `redumix grades` folder: the same place."""
    return records / here.root.relative_to(folder)


def forgetting_dir(here: RunDir, task: str) -> RunDir:
    """Where a model's greedy on another task of `evidence.forgetting` is (run as that run's "base" checkpoint)."""
    return RunDir(here.root / "forgetting" / task)


def _correct(records: list[dict]) -> dict[str, bool]:
    return {r["id"]: bool(r["correct"]) for r in records}


def summarize_evidence(config: Config, folder: Path, plan: list[tuple[str, int]],
                       forgetting: list[str] = (), records: Path | None = None) -> dict[str, Any]:
    """`forgetting`: the task names of `evidence.forgetting`, each a part (a column) like the test split. What a run
    folder under `folder` lacks is read from the same place in `records` (`evidence.records`, committed grades)."""

    def read(here: RunDir, name: str) -> dict | None:
        """A JSON file of a run folder, else of its place in the records; None when neither has it."""
        for path in [here.root / name, *([recorded_place(records, folder, here) / name] if records else [])]:
            if path.is_file():
                return read_json(path)
        return None

    def grades(here: RunDir, checkpoint: str) -> list[dict]:
        """A greedy eval's lines (id, correct, tokens: all a table reads), from its records or its grades."""
        path = records_path(here.eval / "generations", checkpoint, BASELINE)
        if not path.is_file() and records is not None:
            path = recorded_place(records, folder, here) / path.name
        return read_records(path)

    base = RunDir(folder / "base")
    parts = ["test", "variant"] if config.task.name == "arith" else ["test"]
    base_parts = {"test": _correct(grades(base, "base"))}
    if "variant" in parts:
        base_parts["variant"] = _correct(grades(RunDir(base.root / "variant"), "base"))
    for task in forgetting:
        base_parts[task] = _correct(grades(forgetting_dir(base, task), "base"))
    parts += list(forgetting)
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    general = None
    for arm, seed in plan:
        here = arm_dir(folder, arm, seed)
        marker = here.train / "metrics.json"  # its copy in the records is train-metrics.json
        trained = read_json(marker) if marker.is_file() else read(here, "train-metrics.json")
        if trained is None:
            raise FileNotFoundError(f"{marker}: arm {arm}, seed {seed} has not trained, and no records hold it")
        drift = read(here, "drift.json")
        tuned = grades(here, "tuned")
        runs.setdefault(arm, {})[seed] = {
            "test": _correct(tuned),
            "drift_kl": (drift or {}).get("kl_tuned_base"),
            "offtask_kl": (drift or {}).get("kl_offtask"),
            "text_nll": (drift or {}).get("text_nll"),
            "heldout_kl": trained["heldout_kl_merged"],
            "seconds_per_step": trained["seconds_per_step"],
            "steps": trained["steps"],
            "mean_tokens": _mean([r["tokens"] for r in tuned]),
            "harvest": trained.get("inputs", {}).get("harvest"),
            "drift_measured": drift is not None,
        }
        if "variant" in parts:
            runs[arm][seed]["variant"] = _correct(grades(RunDir(here.root / "variant"), "base"))
        for task in forgetting:
            runs[arm][seed][task] = _correct(grades(forgetting_dir(here, task), "base"))
        drift = drift or {}
        if "kl_offtask" in drift:
            general = {"path": config.evidence.general_path, "prompts": drift["offtask_prompts"],
                       "texts": drift["texts"], "base_text_nll": drift["text_nll_base"]}
    arms = {arm: arm_summary(seeds) for arm, seeds in runs.items()}
    reference = "mixture" if "mixture" in runs else next(iter(runs))
    comparisons = {arm: {part: paired_arms(runs[reference], runs[arm], part) for part in parts}
                   for arm in runs if arm != reference}
    vs_base = {arm: {part: paired_arms({0: {part: base_parts[part]}}, seeds, part, shared_reference=True)
                     for part in parts}
               for arm, seeds in runs.items()}
    base_acc = _mean(list(base_parts["test"].values()))
    gold_share = None
    if "gold" in arms and "mixture" in arms:
        gold_gain = arms["gold"]["test"]["mean"] - base_acc
        gold_share = (arms["mixture"]["test"]["mean"] - base_acc) / gold_gain if gold_gain > 0 else None
    return {
        "task": config.task.name,
        "n": config.evidence.n,
        "parts": parts,
        "forgetting": {task: config.evidence.forgetting[i] for i, task in enumerate(forgetting)},
        "variant_number_max": config.evidence.variant_number_max if "variant" in parts else None,
        "seeds": config.evidence.seeds,
        "drift_n": config.evidence.drift_n,
        "general": general,
        "base": {part: _accuracy(correct) for part, correct in base_parts.items()},
        "arms": arms,
        "reference": reference,
        "vs_reference": comparisons,
        "vs_base": vs_base,
        "mixture_share_of_gold_gain": gold_share,
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _accuracy(correct: dict[str, bool]) -> dict[str, Any]:
    hits, n = sum(correct.values()), len(correct)
    low, high = wilson_interval(hits, n)
    return {"accuracy": hits / n, "n": n, "ci_low": low, "ci_high": high}


def arm_summary(seeds: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Mean and spread (min–max) over seeds of each measure."""

    def spread(values: list[float | None]) -> dict[str, Any]:
        """Over the seeds where the measure is defined (a held-out KL with no held-out rows is null); all None if
        none is."""
        defined = [v for v in values if v is not None and math.isfinite(v)]
        if not defined:
            return {"mean": None, "min": None, "max": None, "values": values}
        return {"mean": _mean(defined), "min": min(defined), "max": max(defined), "values": values}

    def per_seed(key: str) -> list[float]:
        return [s[key] if not isinstance(s[key], dict) else _mean(list(s[key].values())) for s in seeds.values()]

    first = next(iter(seeds.values()))
    keys = [key for key in first if key not in ("steps", "harvest", "drift_measured")]
    return {"seeds": list(seeds), **{key: spread(per_seed(key)) for key in keys}, "steps": first["steps"],
            "harvests": [s["harvest"] for s in seeds.values()],
            "drift_measured": all(s["drift_measured"] for s in seeds.values())}


def paired_arms(
    reference: dict[int, dict[str, Any]], other: dict[int, dict[str, Any]], part: str, shared_reference: bool = False,
    resamples: int = 2000,
) -> dict[str, Any]:
    """other − reference in accuracy on the same problems, each seed against the same seed (or one shared reference,
    the base). The 95% interval is a paired bootstrap over problems (a problem's seeds move together); McNemar's
    exact p is on the discordant pairs pooled over seeds."""
    seeds = [s for s in other if shared_reference or s in reference]
    ids = sorted(set.intersection(*(set(other[s][part]) for s in seeds)))
    ref = (lambda s: reference[next(iter(reference))][part]) if shared_reference else (lambda s: reference[s][part])
    per_problem = [_mean([int(other[s][part][i]) - int(ref(s)[i]) for s in seeds]) for i in ids]
    gained = sum(other[s][part][i] and not ref(s)[i] for s in seeds for i in ids)
    lost = sum(ref(s)[i] and not other[s][part][i] for s in seeds for i in ids)
    rng = random.Random(0)
    boot = sorted(_mean(rng.choices(per_problem, k=len(per_problem))) for _ in range(resamples))
    return {"change": _mean(per_problem), "low": boot[int(0.025 * resamples)], "high": boot[int(0.975 * resamples)],
            "gained": gained, "lost": lost, "mcnemar_p": mcnemar_exact_p(gained, lost), "problems": len(ids),
            "seeds": len(seeds)}


def evidence_markdown(summary: dict[str, Any]) -> str:
    ref = summary["reference"]
    base = summary["base"]
    parts = summary["parts"]
    general = summary.get("general")
    complete = summary.get("complete", True)
    not_measured = "not measured"
    where = (f"on {summary['n']} held-out test problems and on a task variant no arm trains on (numbers up to "
             f"{summary['variant_number_max']})" if "variant" in parts else f"on {summary['n']} held-out test prompts")
    measured = sum(len(a["seeds"]) for a in summary["arms"].values())
    lines = [
        "# Evidence: what the distillation target buys" if complete else
        f"# Evidence so far: {measured} of {summary['planned']} arm-seeds measured", "",
        *([] if complete else [
            "The stage has not finished: the next run of `redumix evidence` resumes where this one stopped.", ""]),
        f"Greedy accuracy {where}. Mean over seeds [min–max]; seeds: main arms {summary['seeds']}, others the first. "
        f"Paired changes: each seed against the same seed of `{ref}`, on the same problems, with a 95% paired "
        "bootstrap interval over problems and McNemar's exact p on the pooled discordant pairs.", "",
        "Drift from the base, per token: KL(tuned ‖ base) on the task (the tuned model's own greedy answers to "
        f"{summary['drift_n']} test prompts)" + (
            f"; KL(tuned ‖ base) off the task (the base's greedy answers to {general['prompts']} questions of "
            f"`{general['path']}`, the same tokens for every arm); and the loss (NLL per token) of {general['texts']} "
            f"reference texts of that file read as plain text, where the base's is {general['base_text_nll']:.4f}"
            if general else "") + ".", "",
        "Base: " + ", ".join(f"{part} {base[part]['accuracy']:.1%} [{base[part]['ci_low']:.1%}–"
                             f"{base[part]['ci_high']:.1%}] (n={base[part]['n']})" for part in parts) + ".", "",
    ]
    forgetting = summary.get("forgetting") or {}
    if forgetting:
        lines += ["Forgetting as accuracy: the same greedy on other tasks, each against the base on the same "
                  "problems: " + "; ".join(f"{task} (`{entry}`)" for task, entry in forgetting.items()) + ".", ""]
    header = ["arm", "seeds"]
    for part in parts:
        header += [f"{part} accuracy", f"vs base ({part})"]
    header += ["KL(tuned ‖ base), task"]
    if general:
        header += ["KL(tuned ‖ base), off task", "text NLL"]
    header += ["held-out KL to p_mix", "s/step"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for arm, a in summary["arms"].items():
        vb = summary["vs_base"][arm]
        cells = [arm, str(len(a["seeds"]))]
        for part in parts:
            cells += [_pct(a[part]), _change(vb[part])]
        # A drift never measured (an arm-seed read from records made before drift came with every arm) is said so.
        measured_drift = a.get("drift_measured", True)
        cells += [_num(a["drift_kl"], "undefined (no answer tokens)" if measured_drift else not_measured)]
        if general:
            cells += [_num(a["offtask_kl"], "undefined (no answer tokens)" if measured_drift else not_measured),
                      _num(a["text_nll"], "undefined (no text)" if measured_drift else not_measured)]
        cells += [_num(a["heldout_kl"], "undefined (no held-out rows)"), f"{a['seconds_per_step']['mean']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    harvests: dict[str, list[str]] = {}
    for arm, a in summary["arms"].items():
        for seed, harvest in zip(a["seeds"], a.get("harvests") or [None] * len(a["seeds"]), strict=True):
            harvests.setdefault(str(harvest), []).append(f"{arm} {seed}")
    if len(harvests) > 1:  # a lost run folder's harvest, drawn again: the same problems, other samples
        lines += ["", f"The arm-seeds learned from {len(harvests)} harvests of the recipe (the same problems, other "
                      "samples; by manifest hash): " + "; ".join(f"`{h}`: {', '.join(names)}"
                                                                 for h, names in harvests.items()) + "."]
    lines += ["", f"## Paired against `{ref}`", "",
              "| arm | " + " | ".join(f"{part}: change [95% CI] (gained / lost, p)" for part in parts) + " |",
              "|---|" + "---|" * len(parts)]
    for arm, c in summary["vs_reference"].items():
        lines.append(f"| {arm} | " + " | ".join(_change(c[part]) for part in parts) + " |")
    share = summary["mixture_share_of_gold_gain"]
    if share is not None:
        lines += ["", f"The mixture arm reaches **{share:.0%}** of the gold-SFT arm's gain over the base (test, mean "
                      "over seeds)."]
    return "\n".join(lines) + "\n"


def _pct(s: dict[str, float]) -> str:
    if s["min"] == s["max"]:
        return f"{s['mean']:.1%}"
    return f"{s['mean']:.1%} [{s['min']:.1%}–{s['max']:.1%}]"


def _num(s: dict[str, Any], undefined: str = "undefined") -> str:
    """Mean [min–max] over seeds; `undefined` (what to write, and why) when no seed has the measure."""
    if s["mean"] is None:
        return undefined
    if s["min"] == s["max"]:
        return f"{s['mean']:.4f}"
    return f"{s['mean']:.4f} [{s['min']:.4f}–{s['max']:.4f}]"


def _change(c: dict[str, Any]) -> str:
    return (f"{c['change'] * 100:+.1f} [{c['low'] * 100:+.1f}, {c['high'] * 100:+.1f}] "
            f"({c['gained']} / {c['lost']}, p={c['mcnemar_p']:.2g})")


def plot_evidence(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(summary["arms"])
    parts = summary.get("parts", ["test", "variant"])
    fig, axes = plt.subplots(1, len(parts), figsize=(5.5 * len(parts), 4.6), squeeze=False)
    titles = {"test": "held-out test", "variant": "held-out variant"}
    for ax, part in zip(axes[0], parts, strict=True):
        title = f"{titles.get(part, part + ' (forgetting)')}, n = {summary['base'][part]['n']}"
        means = [100 * summary["arms"][a][part]["mean"] for a in arms]
        # Never negative: seeds that agree give a mean a rounding error outside their min and max.
        low = [max(0.0, m - 100 * summary["arms"][a][part]["min"]) for a, m in zip(arms, means, strict=True)]
        high = [max(0.0, 100 * summary["arms"][a][part]["max"] - m) for a, m in zip(arms, means, strict=True)]
        ax.bar(range(len(arms)), means, yerr=[low, high], capsize=3, color="tab:blue")
        ax.axhline(100 * summary["base"][part]["accuracy"], color="black", linestyle="--", label="base")
        ax.set_xticks(range(len(arms)), arms, rotation=35, ha="right")
        ax.set_ylabel("greedy accuracy, %")
        ax.set_title(title)
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Greedy accuracy of each evidence arm, every arm trained the same steps from the same base")
    seeds = ", ".join(str(s) for s in summary.get("seeds", []))
    fig.text(0.01, 0.01, f"The same problems for every arm in a part; the mean over seeds {seeds} for the main "
             "arms (error bars: min–max), the first seed for the others", fontsize=8)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
