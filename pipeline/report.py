"""Eval's report: one row per (checkpoint, decoder) with accuracy and its 95% Wilson interval, tokens, FPE and wall
time; Markdown for people, and a plot of accuracy against compute.

Each decoder's trade-off against greedy is reported twice. Paired: on the examples it shares with greedy on the same
checkpoint, the accuracy difference with Newcombe's hybrid score interval for paired proportions, the examples it
fixed and broke, McNemar's exact p-value and its FPE relative to greedy. Unpaired: the Pareto front of accuracy
against mean FPE per checkpoint, drawn on the plot and listed in the Markdown.

What training bought is the same paired comparison across checkpoints: each decoder on the tuned checkpoint
against itself on the base one (`tuned_vs_base`), so "did distillation help, by how much" is one row.

A task with named sub-scores (`constraints`: one per kind of constraint) gets each one's pass rate per row
(`sub_scores` in report.json, a table in report.md). A task with blind replies (`constraints`: a template built from
the constraints alone, and `ok`) gets their pass rates on greedy's examples, graded by the task's own checker: what a
reply that answers nothing scores, at no model call (`blind_replies` in report.json, a table under the main one)."""

from __future__ import annotations

from typing import Any

from redumix.data.task import Example, Task
from redumix.generate.report_details import ReportDetails
from redumix.pipeline.decoders import BASELINE, DECODERS, DecoderEntry, family
from redumix.pipeline.stats import mcnemar_exact_p, newcombe_paired_interval, pareto_front, quantiles, wilson_interval


def summarize(
    checkpoint: str, decoder: str, records: list[dict], greedy: list[dict] | None = None,
    details: ReportDetails | None = None,
) -> dict[str, Any]:
    """One report row. With `greedy` (the greedy records of the same checkpoint) a decoder other than greedy also
    gets the paired comparison of `paired_with_greedy`; without it, or when nothing pairs, those keys are absent.
    `details` is what the decoder's table line declares its records' `extra` adds (generate/report_details.py)."""
    n = len(records)
    right = sum(r["correct"] for r in records)
    low, high = wilson_interval(right, n)
    tokens = sum(r["tokens"] for r in records)
    wall = sum(r["seconds"] for r in records)
    row = {
        "checkpoint": checkpoint,
        "decoder": decoder,
        "accuracy": right / max(n, 1),
        "n": n,
        "ci_low": low,
        "ci_high": high,
        "mean_tokens": tokens / max(n, 1),
        "mean_fpe": sum(r["fpe"] for r in records) / max(n, 1),
        "prefill_tokens": sum(r["prefill_tokens"] for r in records) / max(n, 1),
        "wall_s": round(wall, 2),
        "tokens_per_s": tokens / wall if wall else 0.0,
    }
    if details is not None and records:  # what the decoder declared its records' `extra` adds
        row.update(details.summarize(records, n, tokens))
    if records and all("sub_scores" in r for r in records):
        row["sub_scores"] = sub_score_rates(records)
    if greedy and decoder != BASELINE:
        row.update(paired_with_greedy(records, greedy))
    if n == 0:  # nothing was scored: a rate of nothing is undefined, not 0 (JSON null; the Markdown says so)
        row.update(accuracy=None, ci_low=None, ci_high=None, mean_tokens=None, mean_fpe=None, prefill_tokens=None)
    return row


def sub_score_rates(records: list[dict]) -> dict[str, dict[str, Any]]:
    """Each named sub-score of the records (a task's `sub_scores`, e.g. one per constraint kind), by name in sorted
    order: how many of the records it applies to passed it, out of how many, and the rate."""
    passed: dict[str, list[bool]] = {}
    for record in records:
        for name, verdict in record["sub_scores"].items():
            passed.setdefault(name, []).append(bool(verdict))
    return {name: {"passed": sum(v), "n": len(v), "rate": sum(v) / len(v)} for name, v in sorted(passed.items())}


def blind_replies(task: Task, examples: list[Example]) -> list[dict[str, Any]]:
    """Each of the task's blind replies (`blind_replies(example) -> {name: text}`, optional; none without it) graded
    with its `is_correct` on `examples`: how many pass, the rate and its 95% Wilson interval."""
    replies = getattr(task, "blind_replies", None)
    if replies is None:
        return []
    passed: dict[str, list[bool]] = {}
    for example in examples:
        for name, text in replies(example).items():
            passed.setdefault(name, []).append(task.is_correct(text, example))
    rows = []
    for name, verdicts in passed.items():
        right, n = sum(verdicts), len(verdicts)
        low, high = wilson_interval(right, n)
        rows.append({"reply": name, "passed": right, "n": n, "accuracy": right / n, "ci_low": low, "ci_high": high})
    return rows


# --- paired comparison with greedy ----------------------------------------------------------------------------------

def paired_with_greedy(records: list[dict], greedy: list[dict]) -> dict[str, Any]:
    """A decoder against greedy on the examples both scored (matched by record id; greedy usually ran on more).

    Pairing removes the between-example variance, so the interval is much narrower than comparing the two
    unpaired Wilson intervals. Accuracy differences are fractions like `accuracy`; the Markdown shows points.
    `fpe_vs_greedy` is the decoder's total FPE over greedy's on the same examples (None if greedy's is 0).
    Empty when no example pairs up.
    """
    by_id = {g["id"]: g for g in greedy}
    pairs = [(bool(r["correct"]), bool(by_id[r["id"]]["correct"]), r["fpe"], by_id[r["id"]]["fpe"])
             for r in records if r["id"] in by_id]
    if not pairs:
        return {}
    n = len(pairs)
    both = sum(mine and theirs for mine, theirs, _, _ in pairs)
    fixed = sum(mine and not theirs for mine, theirs, _, _ in pairs)
    broken = sum(theirs and not mine for mine, theirs, _, _ in pairs)
    low, high = newcombe_paired_interval(both, fixed, broken, n - both - fixed - broken)
    greedy_fpe = sum(p[3] for p in pairs)
    return {
        "paired_n": n,
        "vs_greedy": (fixed - broken) / n,
        "vs_greedy_low": low,
        "vs_greedy_high": high,
        "vs_greedy_fixed": fixed,
        "vs_greedy_broken": broken,
        "mcnemar_p": mcnemar_exact_p(fixed, broken),
        "fpe_vs_greedy": sum(p[2] for p in pairs) / greedy_fpe if greedy_fpe else None,
    }


def tuned_vs_base(
    records: dict[str, dict[str, list[dict]]], base: str = "base", tuned: str = "tuned"
) -> list[dict[str, Any]]:
    """For each decoder that both the `base` and the `tuned` checkpoint ran, tuned against base on the examples
    both scored (matched by record id), in the tuned checkpoint's decoder order. `records` maps a checkpoint's
    label to its decoders' records; `base` is the label of model.path's checkpoint (`eval.base_label`).

    The paired math is `paired_with_greedy`'s with base's records in greedy's place: fixed = base wrong and tuned
    right, broke = the reverse. `change` is tuned − base accuracy on the paired examples (a fraction, like
    `accuracy`); `base_accuracy` and `tuned_accuracy` are on those same examples. A decoder with nothing to pair is
    left out, and so is everything when either checkpoint is missing."""
    before, after = records.get(base, {}), records.get(tuned, {})
    rows = []
    for decoder in [d for d in after if d in before]:
        paired = paired_with_greedy(after[decoder], before[decoder])
        if not paired:
            continue
        shared = {r["id"] for r in before[decoder]} & {r["id"] for r in after[decoder]}
        n = paired["paired_n"]
        rows.append({
            "decoder": decoder, "n": n,
            "base_accuracy": sum(r["correct"] for r in before[decoder] if r["id"] in shared) / n,
            "tuned_accuracy": sum(r["correct"] for r in after[decoder] if r["id"] in shared) / n,
            "change": paired["vs_greedy"], "low": paired["vs_greedy_low"], "high": paired["vs_greedy_high"],
            "fixed": paired["vs_greedy_fixed"], "broken": paired["vs_greedy_broken"],
            "mcnemar_p": paired["mcnemar_p"], "fpe_vs_base": paired["fpe_vs_greedy"],
        })
    return rows


def reflection_diagnostics(records: list[dict]) -> dict | None:
    """Δ-uncertainty and Δ-NLL quantiles of a decoder that reflects (None for one that does not)."""
    if not records or not all("delta_uncertainty" in r["extra"] for r in records):
        return None
    du = [v for r in records for v in r["extra"]["delta_uncertainty"]]
    dn = [v for r in records for v in r["extra"]["delta_nll"]]
    return {"delta_uncertainty": quantiles(du), "delta_nll": quantiles(dn)}


def report_markdown(report: dict, table: dict[str, DecoderEntry] = DECODERS) -> str:
    lines = [
        f"# redumix eval: {report['task']} ({report['split']} split)",
        "",
        "Accuracy with its 95% Wilson interval. FPE counts every token position the model processed (prefill "
        "included); prefill is the mean prompt positions per example. `redumix-oracle` gets verifier feedback, "
        "which knows the gold answer; `redumix-self` uses the model's own critique.",
        "",
        "| checkpoint | decoder | accuracy | 95% CI | n | mean tokens | mean FPE | prefill | wall s | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        if r["accuracy"] is None:
            lines.append(f"| {r['checkpoint']} | {r['decoder']} | undefined (no examples) | – | 0 | – | – | – | "
                         f"{r['wall_s']:.1f} | – |")
            continue
        lines.append(
            f"| {r['checkpoint']} | {r['decoder']} | {r['accuracy']:.1%} | {r['ci_low']:.1%}–{r['ci_high']:.1%} | "
            f"{r['n']} | {r['mean_tokens']:.1f} | {r['mean_fpe']:.0f} | {r['prefill_tokens']:.0f} | "
            f"{r['wall_s']:.1f} | {r['tokens_per_s']:.0f} |"
        )
    if not report["rows"]:
        lines += ["", "No decoder ran: `eval.decoders` (or the checkpoints) left nothing to evaluate."]
    lines += _blind_replies_markdown(report.get("blind_replies", []))  # reports written before them have none
    lines += _tuned_vs_base_markdown(report.get("tuned_vs_base", []))  # reports written before it have none
    described = []  # (row, its decoder's details line) where the decoder declares details and ran on examples
    for r in report["rows"]:
        entry = table.get(family(r["decoder"]))
        if r["accuracy"] is not None and entry is not None and entry.details is not None:
            described.append(f"| {r['checkpoint']} | {r['decoder']} | {entry.details.describe(r)} |")
    if described:
        lines += ["", "| checkpoint | decoder | details |", "|---|---|---|", *described]
    lines += _sub_scores_markdown(report["rows"])
    lines += _paired_markdown(report["rows"]) + _pareto_markdown(report["rows"])
    if report["diagnostics"]:
        lines += ["", "Reflection diagnostics (after − before each reflection; negative is better):", "",
                  "| run | reflections | Δ-uncertainty mean / p10 / p50 / p90 | Δ-NLL mean / p10 / p50 / p90 |",
                  "|---|---|---|---|"]
        for name, d in report["diagnostics"].items():
            cells = []
            for key in ("delta_uncertainty", "delta_nll"):
                q = d[key]
                cells.append("–" if not q["count"] else
                             f"{q['mean']:+.3f} / {q['p10']:+.3f} / {q['p50']:+.3f} / {q['p90']:+.3f}")
            lines.append(f"| {name} | {d['delta_uncertainty']['count']} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def _tuned_vs_base_markdown(rows: list[dict]) -> list[str]:
    """The "tuned vs base (paired)" table: what training bought, decoder by decoder; nothing without both."""
    if not rows:
        return []
    lines = [
        "", "tuned vs base (paired): each decoder on the tuned checkpoint against the same decoder on the base "
        "checkpoint, on the examples both scored (matched by id). Δ accuracy in points, tuned − base, with the 95% "
        "Newcombe hybrid score interval for paired proportions; fixed = base wrong and tuned right, broke = the "
        "reverse; McNemar's exact p on those discordant pairs.", "",
        "| decoder | base | tuned | Δ accuracy (pts) | 95% CI (Newcombe) | fixed / broke | n paired | McNemar p |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['decoder']} | {r['base_accuracy']:.1%} | {r['tuned_accuracy']:.1%} | {100 * r['change']:+.1f} | "
            f"{100 * r['low']:+.1f} to {100 * r['high']:+.1f} | {r['fixed']} / {r['broken']} | {r['n']} | "
            f"{r['mcnemar_p']:.3g} |"
        )
    return lines


def _blind_replies_markdown(rows: list[dict]) -> list[str]:
    """The baselines no model wrote: each blind reply's pass rate; nothing when the task gives none."""
    if not rows:
        return []
    lines = ["", "Baselines that answer no request (the task's blind replies, graded by its own checker on greedy's "
             "examples; no model call):", "", "| reply | accuracy | 95% CI | passed / n |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['reply']} | {r['accuracy']:.1%} | {r['ci_low']:.1%}–{r['ci_high']:.1%} | "
                     f"{r['passed']} / {r['n']} |")
    return lines


def _sub_scores_markdown(rows: list[dict]) -> list[str]:
    """The task's sub-scores, one column per name: each row's pass rate with the examples it applies to; nothing
    when the task gives none."""
    scored = [r for r in rows if r.get("sub_scores")]
    if not scored:
        return []
    names = sorted({name for r in scored for name in r["sub_scores"]})
    lines = ["", "Pass rate per sub-score (the task's own checks; for `constraints`, one per kind of constraint), "
             "over the examples it applies to (their number in brackets):", "",
             "| checkpoint | decoder | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for r in scored:
        cells = []
        for name in names:
            score = r["sub_scores"].get(name)
            cells.append("–" if score is None else f"{score['rate']:.0%} ({score['n']})")
        lines.append(f"| {r['checkpoint']} | {r['decoder']} | " + " | ".join(cells) + " |")
    return lines


def _paired_markdown(rows: list[dict]) -> list[str]:
    """The "vs greedy (paired)" table; nothing when no row was compared with greedy."""
    paired = [r for r in rows if "vs_greedy" in r]
    if not paired:
        return []
    lines = [
        "", "vs greedy (paired): each decoder against greedy of the same checkpoint on the examples both scored "
        "(matched by id). Δ accuracy in points, decoder − greedy, with the 95% Newcombe hybrid score interval for "
        "paired proportions (Newcombe 1998, method 10); fixed = greedy wrong and decoder right, broke = the reverse; "
        "McNemar's exact p on those discordant pairs; FPE × greedy is the decoder's FPE over greedy's on the same "
        "examples.", "",
        "| checkpoint | decoder | Δ accuracy (pts) | 95% CI (Newcombe) | fixed / broke | n paired | McNemar p | "
        "FPE × greedy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in paired:
        ratio = "–" if r["fpe_vs_greedy"] is None else f"{r['fpe_vs_greedy']:.2f}×"
        lines.append(
            f"| {r['checkpoint']} | {r['decoder']} | {100 * r['vs_greedy']:+.1f} | "
            f"{100 * r['vs_greedy_low']:+.1f} to {100 * r['vs_greedy_high']:+.1f} | "
            f"{r['vs_greedy_fixed']} / {r['vs_greedy_broken']} | {r['paired_n']} | {r['mcnemar_p']:.3g} | {ratio} |"
        )
    return lines


def _pareto_markdown(rows: list[dict]) -> list[str]:
    """One line per checkpoint naming the decoders on its accuracy-vs-FPE Pareto front, cheapest first."""
    front = pareto_front(rows)
    if not front:
        return []
    lines = ["", "Pareto front of accuracy against mean FPE (no other decoder of the checkpoint is at least as "
             "accurate for no more FPE; point estimates, on each decoder's own examples), cheapest first:", ""]
    for checkpoint in dict.fromkeys(r["checkpoint"] for r in front):
        names = [r["decoder"] for r in sorted(front, key=lambda r: r["mean_fpe"]) if r["checkpoint"] == checkpoint]
        lines.append(f"- {checkpoint}: {', '.join(names)}")
    return lines
