"""The ladder's table from its per-problem grades (pipeline/studies/ladder.py measures; this file only reads): each
arm's accuracy, fixes, breaks and repeats, paired against the resample on the wrong attempts, the table at equal
samples (`ladder.md`, summary.json), and a repair, a repeat and a break of each arm (examples.md). The grades alone
give the table again (docs/records/README.md)."""

from __future__ import annotations

import math

from redumix.pipeline.stats import newcombe_paired_interval, wilson_interval

RESAMPLE = "resample"


def _repeats(arm: dict, attempt: dict) -> bool:
    """The arm gives the attempt's answer again (or, with no answer to compare, its text)."""
    if attempt["answer"] is not None or arm["answer"] is not None:
        return arm["answer"] == attempt["answer"]
    return arm["text"].strip() == attempt["text"].strip()


def summarize_ladder(rows: list[dict], arms: list[str]) -> dict:
    """Per arm: accuracy, fixed and broken against the attempt, repeats, and on the wrong attempts the arm against
    the resample, paired (Newcombe's interval over the same problems)."""
    n = len(rows)
    wrong = [r for r in rows if not r["attempt"]["correct"]]
    wrong_ids = {r["id"] for r in wrong}
    attempt_right = n - len(wrong)
    summary: dict = {"n": n, "attempt_correct": attempt_right, "attempt_accuracy": _share(attempt_right, n),
                     "wrong_attempts": len(wrong), "arms": {}}
    for name in arms:
        right = sum(r["arms"][name]["correct"] for r in rows)
        fixed = [r["id"] for r in wrong if r["arms"][name]["correct"]]
        broken = [r["id"] for r in rows if r["attempt"]["correct"] and not r["arms"][name]["correct"]]
        repeats = [r["id"] for r in rows if _repeats(r["arms"][name], r["attempt"])]
        repeats_on_wrong = [i for i in repeats if i in wrong_ids]
        table = {"both": 0, "fixed": 0, "broken": 0, "neither": 0}  # on wrong attempts: the arm against the resample
        for r in wrong:
            arm, base = r["arms"][name]["correct"], r["arms"][RESAMPLE]["correct"]
            table["both" if arm and base else "fixed" if arm else "broken" if base else "neither"] += 1
        summary["arms"][name] = {
            "accuracy": _share(right, n), "accuracy_interval": wilson_interval(right, n),
            "fixed": len(fixed), "broken": len(broken),
            "repeats": _share(len(repeats), n), "repeats_on_wrong": _share(len(repeats_on_wrong), len(wrong)),
            "keep_right_accuracy": _share(attempt_right + len(fixed), n),  # the redo only where the attempt was wrong
            "vs_resample_on_wrong": _share(table["fixed"] - table["broken"], len(wrong)),
            "vs_resample_interval": newcombe_paired_interval(**table), "vs_resample_table": table,
            "mean_tokens": _share(sum(r["arms"][name]["tokens"] for r in rows), n),
            "examples": {"fixed": fixed[:3], "broken": broken[:3], "repeat_on_wrong": repeats_on_wrong[:3]},
        }
    quoting = [r for r in wrong if r.get("reflection_quotes_attempt")]  # grades made before it lack the key
    if any("reflection_quotes_attempt" in r for r in rows):
        summary["reflection_quotes_attempt"] = {
            "wrong_attempts": len(quoting),
            "arms": {name: {"repeats": sum(_repeats(r["arms"][name], r["attempt"]) for r in quoting),
                            "fixed": sum(r["arms"][name]["correct"] for r in quoting)} for name in arms}}
    resamples = [name for name in arms if name.startswith(RESAMPLE)]
    if len(resamples) > 1:
        summary |= equal_samples(rows, wrong, [name for name in arms if name not in resamples], resamples)
    return summary


def equal_samples(rows: list[dict], wrong: list[dict], redos: list[str], resamples: list[str]) -> dict:
    """Two tries after a wrong attempt, keeping the one the verifier passes: each redo with the first resample
    against the first two resamples, paired on the wrong attempts; and k attempts per problem, the wrong attempts
    fixed by any of the first k resamples (rejection sampling's curve)."""
    two = [RESAMPLE, resamples[1]]
    passes = lambda r, names: any(r["arms"][n]["correct"] for n in names)  # noqa: E731
    attempt_right = len(rows) - len(wrong)
    pairs = {}
    for name in [f"{RESAMPLE}+{resamples[1]}", *(f"{redo}+{RESAMPLE}" for redo in redos)]:
        names = name.split("+")
        table = {"both": 0, "fixed": 0, "broken": 0, "neither": 0}  # the pair against the two resamples
        for r in wrong:
            pair, base = passes(r, names), passes(r, two)
            table["both" if pair and base else "fixed" if pair else "broken" if base else "neither"] += 1
        fixed = table["both"] + table["fixed"]
        pairs[name] = {"fixed": fixed, "keep_right_accuracy": _share(attempt_right + fixed, len(rows)),
                       "vs_two_resamples_on_wrong": _share(table["fixed"] - table["broken"], len(wrong)),
                       "vs_two_resamples_interval": newcombe_paired_interval(**table),
                       "vs_two_resamples_table": table}
    best_of = [sum(passes(r, resamples[:k]) for r in wrong) for k in range(1, len(resamples) + 1)]
    return {"equal_samples": pairs, "best_of_resamples_fixed": best_of}


def _share(part: float, whole: int) -> float:
    return part / whole if whole else math.nan


def ladder_table(summary: dict) -> str:
    """The summary as a markdown table, percentages to one decimal."""
    pct = lambda x: f"{100 * x:.1f}"  # noqa: E731
    lines = [f"n = {summary['n']} train problems; first attempt {pct(summary['attempt_accuracy'])}% right "
             f"({summary['wrong_attempts']} wrong)", "",
             "| arm | accuracy | fixed / broken | repeats the attempt's answer (all / wrong) | on wrong attempts: "
             "arm − resample [95% CI] | redo only the wrong |",
             "|---|---|---|---|---|---|"]
    for name, arm in summary["arms"].items():
        low, high = arm["vs_resample_interval"]
        vs = "–" if name == RESAMPLE else f"{pct(arm['vs_resample_on_wrong'])} [{pct(low)}, {pct(high)}]"
        lines.append(f"| {name} | {pct(arm['accuracy'])}% | {arm['fixed']} / {arm['broken']} | "
                     f"{pct(arm['repeats'])}% / {pct(arm['repeats_on_wrong'])}% | {vs} | "
                     f"{pct(arm['keep_right_accuracy'])}% |")
    if "equal_samples" in summary:
        lines += ["", "Two tries after a wrong attempt, keeping the one the verifier passes:", "",
                  "| tries | wrong attempts fixed | redo only the wrong | − two resamples, on wrong [95% CI] |",
                  "|---|---|---|---|"]
        for name, pair in summary["equal_samples"].items():
            low, high = pair["vs_two_resamples_interval"]
            vs = "–" if name.count(RESAMPLE) == 2 else (f"{pct(pair['vs_two_resamples_on_wrong'])} "
                                                        f"[{pct(low)}, {pct(high)}]")
            lines.append(f"| {name} | {pair['fixed']} | {pct(pair['keep_right_accuracy'])}% | {vs} |")
        best = ", ".join(f"{k} → {fixed}" for k, fixed in enumerate(summary["best_of_resamples_fixed"], 1))
        lines += ["", f"k resamples per wrong attempt, wrong attempts fixed by any of them: {best}"]
    if "reflection_quotes_attempt" in summary:
        quoting = summary["reflection_quotes_attempt"]
        after = "; ".join(f"{name} repeats {arm['repeats']}, fixes {arm['fixed']}"
                          for name, arm in quoting["arms"].items())
        lines += ["", f"The reflection writes the wrong attempt back as its correction (its code block holds only the "
                  f"attempt's lines) on {quoting['wrong_attempts']} of {summary['wrong_attempts']} wrong attempts; "
                  f"on those: {after}."]
    return "\n".join(lines) + "\n"


EXAMPLE_KINDS = {"fixed": "a repair", "repeat_on_wrong": "a repeat of a wrong attempt", "broken": "a break"}


def ladder_examples(rows: list[dict], summary: dict, lines_shown: int = 40) -> str:
    """For each redo arm, the first repair, repeat and break of the table's counts: the attempt, the feedback, the
    reflection and the redo, in full up to `lines_shown` lines each, to read what a count is made of."""
    by_id = {r["id"]: r for r in rows}

    def block(title: str, text: str) -> list[str]:
        return [title, "", "~~~text", *text.strip().splitlines()[:lines_shown], "~~~", ""]

    out = ["# The ladder's examples", ""]
    for name, arm in summary["arms"].items():
        if name.startswith(RESAMPLE):
            continue
        out += [f"## {name}", ""]
        for kind, what in EXAMPLE_KINDS.items():
            if not arm["examples"][kind]:
                out += [f"### {what}: none", ""]
                continue
            r = by_id[arm["examples"][kind][0]]
            critic = name.startswith("self@")
            out += [f"### {what}: {r['id']}", "",
                    *block(f"The attempt ({_verdict(r['attempt'])}):", r["attempt"]["text"]),
                    *block("The feedback:", r["critique"] if critic else r["feedback"]),
                    *block("The reflection:", r["self_reflection"] if critic else r["reflection"]),
                    *block(f"The redo ({_verdict(r['arms'][name])}):", r["arms"][name]["text"])]
    return "\n".join(out)


def _verdict(graded: dict) -> str:
    return f"{'passes' if graded['correct'] else 'fails'}, {graded['tokens']} tokens"
