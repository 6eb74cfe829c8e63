"""Eval's plot: accuracy (with its Wilson interval) against mean FPE, one colour per checkpoint, the Pareto front
joined, each point labelled where it covers no other label or point."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from redumix.common.files import atomic_write_bytes
from redumix.pipeline.stats import pareto_front


def plot_accuracy_vs_fpe(rows: list[dict], path: Path) -> None:
    """Accuracy (with its Wilson interval) against mean FPE, one colour per checkpoint; the decoders on the
    checkpoint's Pareto front are filled and joined by a step line, the dominated ones hollow. Each point is
    labelled with its decoder in its checkpoint's colour, placed where it covers no other label or point (with a
    leader line when it had to move away); the caption gives n."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6), dpi=120)
    rows = [r for r in rows if r["accuracy"] is not None]
    if not rows:
        ax.text(0.5, 0.5, "no decoder scored an example", ha="center", va="center", transform=ax.transAxes)
    colors = {}
    for i, checkpoint in enumerate(dict.fromkeys(r["checkpoint"] for r in rows)):
        colors[checkpoint] = f"C{i}"
        points = [r for r in rows if r["checkpoint"] == checkpoint]
        _plot_checkpoint(ax, points, checkpoint, color=colors[checkpoint], marker="osD^v"[i % 5])
    ax.set_xscale("log")
    ax.set_xlabel("mean forward-pass equivalents (FPE) per example, log scale")
    ax.set_ylabel("accuracy (%), with its 95% Wilson interval")
    ax.set_title("Accuracy against compute per decoder\nfilled and joined: each checkpoint's Pareto front; hollow: "
                 "dominated", fontsize=11)
    ax.grid(alpha=0.3)
    if rows:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        fig.text(0.01, 0.01, n_caption(rows), fontsize=8, ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    _label_points(fig, ax, rows, colors)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())


def n_caption(rows: list[dict]) -> str:
    """"n = 1000 examples for greedy, 500 for each other decoder": the examples behind each point, grouped by
    count, the commonest count last as "each other decoder"."""
    by_n: dict[int, list[str]] = {}
    for r in rows:
        by_n.setdefault(r["n"], [])
        if r["decoder"] not in by_n[r["n"]]:
            by_n[r["n"]].append(r["decoder"])
    if len(by_n) == 1:
        return f"n = {next(iter(by_n))} examples per decoder and checkpoint"
    commonest = max(by_n, key=lambda n: len(by_n[n]))
    parts = [f"{n} for {', '.join(names)}" for n, names in by_n.items() if n != commonest]
    return f"n = {'; '.join(parts)}; {commonest} for each other decoder (examples per checkpoint)"


def _plot_checkpoint(ax: Any, points: list[dict], checkpoint: str, color: str, marker: str) -> None:
    xs = [r["mean_fpe"] for r in points]
    ys = [100 * r["accuracy"] for r in points]
    # A bar's length is never negative (matplotlib refuses one): a bound a rounding error inside its point draws as 0.
    below = [max(0.0, 100 * (r["accuracy"] - r["ci_low"])) for r in points]
    above = [max(0.0, 100 * (r["ci_high"] - r["accuracy"])) for r in points]
    ax.errorbar(xs, ys, yerr=[below, above], fmt="none", ecolor=color, capsize=3, alpha=0.6)
    front = sorted(pareto_front(points), key=lambda r: r["mean_fpe"])
    # A step after each front point: the best accuracy this checkpoint reaches for at most that much compute.
    ax.step([r["mean_fpe"] for r in front], [100 * r["accuracy"] for r in front], where="post", color=color,
            alpha=0.7, label=f"{checkpoint}: Pareto front")
    dominated = [r for r in points if not any(r is f for f in front)]
    for group, face, label in ((front, color, None), (dominated, "none", f"{checkpoint}: dominated")):
        if group:
            ax.scatter([r["mean_fpe"] for r in group], [100 * r["accuracy"] for r in group], marker=marker,
                       facecolors=face, edgecolors=color, zorder=3, label=label)


# Where a label may go, in points from its point: the diagonals first (a front's step line leaves each point to the
# right, level), then right, left, above and below; then the same farther out.
_DIRECTIONS = [(1, 1), (1, -1), (-1, 1), (-1, -1), (1, 0), (-1, 0), (0, 1), (0, -1)]
_RINGS = (8, 18, 30, 44, 60)  # the first clears the marker (5 points) and a label's margin
_OFFSETS = [(dx * r, dy * r) for r in _RINGS for dx, dy in _DIRECTIONS]


def _label_points(fig: Any, ax: Any, rows: list[dict], colors: dict[str, str]) -> list[tuple[float, ...]]:
    """Each decoder's name beside its point, at the first offset (nearest first) where its box overlaps no label
    placed before it, no point and stays inside the axes; if none is free, where it overlaps least. A label moved
    farther than the nearest ring gets a thin leader line. Needs the final layout: call after tight_layout.
    Returns the labels' boxes in pixels (with their margin), in `rows` order."""
    from matplotlib.text import Text

    renderer = fig.canvas.get_renderer()
    inside = ax.get_window_extent(renderer)
    centres = [ax.transData.transform((r["mean_fpe"], 100 * r["accuracy"])) for r in rows]
    pad, gap = 5 * fig.dpi / 72, 1.5 * fig.dpi / 72  # a marker's half-width and a label's margin, in pixels
    taken = [(x - pad, y - pad, x + pad, y + pad) for x, y in centres]
    labels: dict[int, tuple[float, ...]] = {}
    # Top to bottom, so that the crowded upper labels (the ones a reader looks for) go nearest their points.
    for index in sorted(range(len(rows)), key=lambda i: -rows[i]["accuracy"]):
        r = rows[index]
        best, best_cost = None, None
        for dx, dy in _OFFSETS:
            ha = "left" if dx > 0 else "right" if dx < 0 else "center"
            va = "bottom" if dy > 0 else "top" if dy < 0 else "center"
            far = max(abs(dx), abs(dy)) > _RINGS[0]
            text = ax.annotate(r["decoder"], (r["mean_fpe"], 100 * r["accuracy"]), textcoords="offset points",
                               xytext=(dx, dy), ha=ha, va=va, fontsize=7, color=colors[r["checkpoint"]], zorder=4,
                               # a light backing keeps a label legible where it crosses a step line or a bar
                               bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.7},
                               arrowprops={"arrowstyle": "-", "color": colors[r["checkpoint"]], "lw": 0.5,
                                           "alpha": 0.6} if far else None)
            text.update_positions(renderer)
            box = Text.get_window_extent(text, renderer)  # the words alone: an Annotation's own box has its leader
            box = (box.x0 - gap, box.y0 - gap, box.x1 + gap, box.y1 + gap)  # labels that touch read as one
            cost = sum(_overlap(box, other) for other in taken) + _outside(box, inside)
            if best_cost is None or cost < best_cost:
                if best is not None:
                    best[0].remove()
                best, best_cost = (text, box), cost
            else:
                text.remove()
            if cost == 0:
                break
        taken.append(best[1])
        labels[index] = best[1]
    return [labels[i] for i in range(len(rows))]


def _overlap(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    return max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))


def _outside(box: tuple[float, ...], inside: Any) -> float:
    """The area of `box` outside the axes, weighted so that leaving the plot is worse than touching a label."""
    width, height = box[2] - box[0], box[3] - box[1]
    kept = _overlap(box, (inside.x0, inside.y0, inside.x1, inside.y1))
    return 10 * (width * height - kept)
