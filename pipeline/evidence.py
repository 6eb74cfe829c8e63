"""`redumix evidence`: is the mixture a better target than the alternatives, and where does the gain come from?

Every arm trains the same number of steps, on the same harvested problems, from the same base, then is measured the
same way. The arms are the table in pipeline/evidence_arms.py: the mixture arm (the stored p_mix at the recipe's λ,
verifier feedback: the product's own target), p_mix at λ=0, SFT on the redo, on gold and on the model's own attempts
(controls), p_mix from harvests with other feedback, on-policy training, and TRL's SDFT (the student's samples, a
teacher shown x2). `evidence.main_arms` train with every seed of `evidence.seeds`, `evidence.other_arms` with the
first.

Measured per arm: greedy accuracy on `evidence.n` test problems; greedy accuracy on a task variant no arm trains on
(numbers up to `evidence.variant_number_max`, larger than the recipe's); KL(tuned ‖ base) per token on the tuned
model's own greedy answers to `evidence.drift_n` test prompts; the held-out KL to the stored p_mix; seconds per step.
Paired tests compare arms on the same problems: each seed against the same seed of the mixture arm, pooled by a
paired bootstrap over problems.

RUN_DIR/evidence/ holds one folder per harvest (`harvest-<kind>/`, the recipe's own harvest is RUN_DIR/harvest) and
one run folder per arm and seed (`<arm>/seed-<s>/` with train/, eval/, variant/, drift.json). Every stage resumes as
it does alone; `evidence.json`, `evidence.md` and `evidence.png` are written last.
"""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path
from typing import Any

from redumix.common.files import atomic_write_json, atomic_write_text, read_json
from redumix.common.ranks import print0
from redumix.pipeline.config import Config
from redumix.pipeline.decoders import BASELINE
from redumix.pipeline.drift import drift_measures, greedy_answers, read_general_set
from redumix.pipeline.embedded_stage import ensure_embedded
from redumix.pipeline.eval import run_eval
from redumix.pipeline.evidence_arms import ARMS, HARVESTS
from redumix.pipeline.harvest import run_harvest
from redumix.pipeline.records import read_records, records_path
from redumix.pipeline.resolve import config_to_yaml
from redumix.pipeline.rft import rft_harvest
from redumix.pipeline.run import EMBEDDED, RunDir, arm_dir, model_path
from redumix.pipeline.stats import mcnemar_exact_p, wilson_interval
from redumix.pipeline.train import run_train


def run_evidence(config: Config, run: RunDir) -> dict[str, Any]:
    ensure_embedded(config, run)
    base = model_path(config.model.path, run).resolve()
    ev = config.evidence
    folder = run.evidence
    plan = [(arm, seed) for arm in ev.main_arms for seed in ev.seeds]
    plan += [(arm, ev.seeds[0]) for arm in ev.other_arms if arm not in ev.main_arms]
    eval_greedy(config, RunDir(folder / "base"), base, checkpoint="base")
    steps = 0  # every arm trains as many steps as the first one did (the mixture arm, seed 0, in the default plan)
    trained_arms = []
    for arm, seed in plan:
        harvest = harvest_for(config, run, ARMS[arm].harvest)
        here = arm_dir(folder, arm, seed)
        settings = arm_config(config, base, harvest, arm, seed, steps)
        print0(f"evidence: arm {arm}, seed {seed} in {here.root}")
        here.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(here.config, config_to_yaml(settings))
        trained = run_train(settings, here)
        steps = steps or trained["steps"]
        eval_greedy(settings, here, here.train / "merged", checkpoint="tuned")
        trained_arms.append((settings, here))
    # Drift is the costliest measure (the tuned and the base model over every drift sequence; its cost is in
    # docs/real-models.md) and accuracy the first one asked, so every arm's accuracy is measured before any drift.
    for settings, here in trained_arms:
        measure_drift(settings, here, here.train / "merged", base)
    summary = summarize_evidence(config, folder, plan)
    atomic_write_json(folder / "evidence.json", summary)
    atomic_write_text(folder / "evidence.md", evidence_markdown(summary))
    plot_evidence(summary, folder / "evidence.png")
    print0(evidence_markdown(summary))
    return summary


def harvest_for(config: Config, run: RunDir, kind: str) -> Path:
    """The harvest an arm learns from: the recipe's own in RUN_DIR/harvest, one with one setting changed, or for
    `rft` the recipe's own with `evidence.rft_samples` of the model's samples a problem (pipeline/rft.py)."""
    if kind == "rft":
        own = harvest_for(config, run, "verifier")
        if not config.evidence.rft_samples:
            return own
        return rft_harvest(config, model_path(config.model.path, run).resolve(), own,
                           run.evidence / "harvest-rft")
    if kind == "verifier":
        run_harvest(config, run)
        return run.harvest
    here = RunDir(run.evidence / f"harvest-{kind}")
    settings = dataclasses.replace(config, model=dataclasses.replace(config.model, path=str(run.embedded.resolve()))
                                   if config.model.path == EMBEDDED else config.model,
                                   redumix=dataclasses.replace(config.redumix, **HARVESTS[kind]))
    here.root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(here.config, config_to_yaml(settings))
    run_harvest(settings, here)
    return here.harvest


def arm_config(config: Config, base: Path, harvest: Path, arm: str, seed: int, steps: int) -> Config:
    # The arms compare targets on the harvest's rows alone: the round policy's extra rows (skill rows, replay) are
    # what `redumix ablation` measures, and they would blur a comparison of targets.
    train = dataclasses.replace(config.train, harvest_dir=str(harvest), seed=seed, skill_rows=False, replay=0.0,
                                **ARMS[arm].train)
    if steps:
        train = dataclasses.replace(train, max_steps=steps)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, path=str(base)), train=train)


# --- measuring one model ----------------------------------------------------------------------------------------


def eval_greedy(config: Config, here: RunDir, model: Path, checkpoint: str) -> None:
    """Greedy on the test split and (on arith) on the held-out variant. For the base, also its greedy answers to the
    general set's questions, which every arm's off-task KL reads."""
    ev = config.evidence
    greedy_only = dataclasses.replace(config.eval, decoders=[BASELINE], tuned_decoders=[], n=ev.n, n_other=ev.n,
                                      checkpoints=[checkpoint])
    run_eval(dataclasses.replace(config, model=dataclasses.replace(config.model, path=str(model)),
                                 eval=greedy_only), here)
    if config.task.name == "arith":
        # The variant runs the model as its "base" checkpoint: model.path is the model measured.
        arith = dataclasses.replace(config.task.arith, start_max=ev.variant_number_max,
                                    operand_max=ev.variant_number_max)
        variant = dataclasses.replace(config, model=dataclasses.replace(config.model, path=str(model)),
                                      task=dataclasses.replace(config.task, arith=arith),
                                      eval=dataclasses.replace(greedy_only, checkpoints=["base"]))
        run_eval(variant, RunDir(here.root / "variant"))
    if checkpoint == "base" and ev.general_path:
        general = read_general_set(Path(ev.general_path), ev.drift_n)
        if saved_answers(here, general.questions) is None:
            answers = greedy_answers(config, model, general.questions)
            atomic_write_json(here.root / "general_answers.json", {"questions": general.questions,
                                                                    "answer_ids": answers})


def measure_drift(config: Config, here: RunDir, model: Path, base: Path) -> None:
    """A tuned model's drift from the base (pipeline/drift.py), once: drift.json is read back on a resumed run."""
    ev = config.evidence
    general = read_general_set(Path(ev.general_path), ev.drift_n) if ev.general_path else None
    drift = read_json(here.root / "drift.json") if (here.root / "drift.json").is_file() else {}
    if "kl_tuned_base" in drift and (general is None or "kl_offtask" in drift):
        return
    records = greedy_records(here, "tuned")[: ev.drift_n]
    base_folder = here.root.parents[1] / "base"
    answers = None if general is None else saved_answers(RunDir(base_folder), general.questions)
    base_nll = None if general is None else saved_text_nll(base_folder, general.texts)
    drift = drift_measures(config, model, base, records, general, answers, base_nll)
    atomic_write_json(here.root / "drift.json", drift)
    if general is not None and base_nll is None:
        atomic_write_json(base_folder / "text_nll.json", {"texts": general.texts,
                                                           "text_nll": drift["text_nll_base"]})


def saved_answers(here: RunDir, questions: list[str]) -> list[list[int]] | None:
    """The base's saved greedy answers to `questions`, or None when they were saved for other questions (a longer
    list serves a shorter one: each answer depends on its own question only)."""
    path = here.root / "general_answers.json"
    if not path.is_file():
        return None
    saved = read_json(path)
    if saved["questions"][: len(questions)] != questions:
        return None
    return saved["answer_ids"][: len(questions)]


def saved_text_nll(base_folder: Path, texts: list[str]) -> float | None:
    """The base's loss on exactly these general texts, where an earlier arm measured it."""
    path = base_folder / "text_nll.json"
    if not path.is_file() or (saved := read_json(path))["texts"] != texts:
        return None
    return float(saved["text_nll"])


def greedy_records(here: RunDir, checkpoint: str) -> list[dict]:
    return read_records(records_path(here.eval / "generations", checkpoint, BASELINE))


# --- the summary ------------------------------------------------------------------------------------------------


def _correct(records: list[dict]) -> dict[str, bool]:
    return {r["id"]: bool(r["correct"]) for r in records}


def summarize_evidence(config: Config, folder: Path, plan: list[tuple[str, int]]) -> dict[str, Any]:
    base = RunDir(folder / "base")
    parts = ["test", "variant"] if config.task.name == "arith" else ["test"]
    base_parts = {"test": _correct(greedy_records(base, "base"))}
    if "variant" in parts:
        base_parts["variant"] = _correct(greedy_records(RunDir(base.root / "variant"), "base"))
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    general = None
    for arm, seed in plan:
        here = arm_dir(folder, arm, seed)
        trained = read_json(here.train / "metrics.json")
        drift = read_json(here.root / "drift.json")
        runs.setdefault(arm, {})[seed] = {
            "test": _correct(greedy_records(here, "tuned")),
            "drift_kl": drift["kl_tuned_base"],
            "heldout_kl": trained["heldout_kl_merged"],
            "seconds_per_step": trained["seconds_per_step"],
            "steps": trained["steps"],
            "mean_tokens": _mean([r["tokens"] for r in greedy_records(here, "tuned")]),
        }
        if "variant" in parts:
            runs[arm][seed]["variant"] = _correct(greedy_records(RunDir(here.root / "variant"), "base"))
        if "kl_offtask" in drift:
            runs[arm][seed].update(offtask_kl=drift["kl_offtask"], text_nll=drift["text_nll"])
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

    keys = [key for key in ("test", "variant", "drift_kl", "offtask_kl", "text_nll", "heldout_kl",
                            "seconds_per_step", "mean_tokens") if key in next(iter(seeds.values()))]
    return {"seeds": list(seeds), **{key: spread(per_seed(key)) for key in keys},
            "steps": next(iter(seeds.values()))["steps"]}


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
    where = (f"on {summary['n']} held-out test problems and on a task variant no arm trains on (numbers up to "
             f"{summary['variant_number_max']})" if "variant" in parts else f"on {summary['n']} held-out test prompts")
    lines = [
        "# Evidence: what the distillation target buys", "",
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
                             f"{base[part]['ci_high']:.1%}]" for part in parts) + f" (n={base['test']['n']}).", "",
    ]
    header = ["arm", "seeds", "test accuracy", "vs base (test)"]
    if "variant" in parts:
        header += ["variant accuracy", "vs base (variant)"]
    header += ["KL(tuned ‖ base), task"]
    if general:
        header += ["KL(tuned ‖ base), off task", "text NLL"]
    header += ["held-out KL to p_mix", "s/step"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for arm, a in summary["arms"].items():
        vb = summary["vs_base"][arm]
        cells = [arm, str(len(a["seeds"])), _pct(a["test"]), _change(vb["test"])]
        if "variant" in parts:
            cells += [_pct(a["variant"]), _change(vb["variant"])]
        cells += [_num(a["drift_kl"], "undefined (no answer tokens)")]
        if general:
            cells += [_num(a["offtask_kl"], "undefined (no answer tokens)"),
                      _num(a["text_nll"], "undefined (no text)")]
        cells += [_num(a["heldout_kl"], "undefined (no held-out rows)"), f"{a['seconds_per_step']['mean']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
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
        title = titles[part]
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
    fig.text(0.01, 0.01, f"n = {summary['n']} problems per arm and part; the mean over seeds {seeds} for the main "
             "arms (error bars: min–max), the first seed for the others", fontsize=8)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
