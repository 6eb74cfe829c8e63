"""Eval's report: one row per (checkpoint, decoder) with accuracy and its 95% Wilson interval, tokens, FPE and wall
time; Markdown for people, and a plot of accuracy against compute."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from redumix.pipeline.run import atomic_write_bytes


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, center - half), min(1.0, center + half)


def summarize(checkpoint: str, decoder: str, records: list[dict]) -> dict[str, Any]:
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
    # Details come from what the decoder kept per record, not from its name.
    extras = [r["extra"] for r in records]
    if extras and all("original_correct" in x for x in extras):
        row["fixed"] = sum(r["correct"] and not r["extra"]["original_correct"] for r in records)
        row["broken"] = sum(r["extra"]["original_correct"] and not r["correct"] for r in records)
    if extras and all("longest_context" in x for x in extras):
        row["longest_context"] = max((r["extra"]["longest_context"] for r in records), default=0)
        per_round = [r["extra"]["tokens_per_round"] for r in records]
        row["tokens_per_round"] = [sum(x) / len(per_round) for x in zip(*per_round, strict=True)] if per_round else []
    if extras and all("n_reflections" in x for x in extras):
        row["reflections_per_example"] = sum(r["extra"]["n_reflections"] for r in records) / max(n, 1)
        row["hidden_tokens_per_example"] = sum(r["extra"]["hidden_tokens"] for r in records) / max(n, 1)
    return row


def _quantiles(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"count": 0}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"count": len(ordered), "mean": sum(ordered) / len(ordered), "p10": pick(0.1), "p50": pick(0.5),
            "p90": pick(0.9)}


def reflection_diagnostics(records: list[dict]) -> dict | None:
    """Δ-uncertainty and Δ-NLL quantiles of a decoder that reflects (None for one that does not)."""
    if not records or not all("delta_uncertainty" in r["extra"] for r in records):
        return None
    du = [v for r in records for v in r["extra"]["delta_uncertainty"]]
    dn = [v for r in records for v in r["extra"]["delta_nll"]]
    return {"delta_uncertainty": _quantiles(du), "delta_nll": _quantiles(dn)}


def report_markdown(report: dict) -> str:
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
        lines.append(
            f"| {r['checkpoint']} | {r['decoder']} | {r['accuracy']:.1%} | {r['ci_low']:.1%}–{r['ci_high']:.1%} | "
            f"{r['n']} | {r['mean_tokens']:.1f} | {r['mean_fpe']:.0f} | {r['prefill_tokens']:.0f} | "
            f"{r['wall_s']:.1f} | {r['tokens_per_s']:.0f} |"
        )
    extras = [r for r in report["rows"] if "fixed" in r or "longest_context" in r or "reflections_per_example" in r]
    if extras:
        lines += ["", "| checkpoint | decoder | details |", "|---|---|---|"]
        for r in extras:
            if "fixed" in r:
                detail = f"fixed {r['fixed']}, broke {r['broken']} (vs. its own first attempt)"
            elif "longest_context" in r:
                rounds = ", ".join(f"{t:.0f}" for t in r["tokens_per_round"])
                detail = f"tokens per round [{rounds}], longest context {r['longest_context']}"
            else:
                detail = (f"{r['reflections_per_example']:.2f} reflections and "
                          f"{r['hidden_tokens_per_example']:.1f} hidden tokens per example")
            lines.append(f"| {r['checkpoint']} | {r['decoder']} | {detail} |")
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


def plot_accuracy_vs_fpe(rows: list[dict], path: Path) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for checkpoint, marker in (("base", "o"), ("tuned", "s")):
        points = [r for r in rows if r["checkpoint"] == checkpoint]
        if not points:
            continue
        xs = [r["mean_fpe"] for r in points]
        ys = [100 * r["accuracy"] for r in points]
        below = [100 * (r["accuracy"] - r["ci_low"]) for r in points]
        above = [100 * (r["ci_high"] - r["accuracy"]) for r in points]
        errors = [below, above]
        ax.errorbar(xs, ys, yerr=errors, fmt=marker, capsize=3, label=checkpoint, alpha=0.85)
        for r, x, y in zip(points, xs, ys, strict=True):
            ax.annotate(r["decoder"], (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("mean forward-pass equivalents per example (log scale)")
    ax.set_ylabel("accuracy (%), 95% Wilson interval")
    ax.set_title("Accuracy against compute, per checkpoint and decoder")
    ax.grid(alpha=0.3)
    ax.legend()
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=120)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())
