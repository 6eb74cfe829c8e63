"""The statistics that the stages share: Wilson intervals, Newcombe's paired interval, McNemar's exact test, the
Pareto front and quantiles. Pure functions of counts and rows; eval, harvest, evidence, rounds and ablation import
them from here."""

from __future__ import annotations

import math


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95% Wilson score interval of successes / n; (0, 1) with no trials. It always holds the point: at 0% or
    100% a bound equals the point in exact arithmetic, and floating point may land it a hair inside (at 4 of 4 the
    upper bound came out 0.9999999999999999), so each bound is clamped to the point as well as to [0, 1]."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, min(p, center - half)), min(1.0, max(p, center + half))


def newcombe_paired_interval(
    both: int, fixed: int, broken: int, neither: int, z: float = 1.959964
) -> tuple[float, float]:
    """95% interval for a difference of paired proportions, decoder − greedy = (fixed − broken) / n, by Newcombe's
    hybrid score method (Newcombe 1998, Stat. Med. 17:2635-2650, method 10; also called "square-and-add").

    Each accuracy gets its Wilson interval; the distances from each estimate to its limits are combined as for a
    difference, but with the correlation φ of the paired outcomes, which narrows the interval when the two
    decoders mostly agree. Closed form, stays inside [-1, 1], and is sane with no discordant pairs, unlike Wald.
    The table: `both` right, `fixed` (decoder right, greedy wrong), `broken` (greedy right, decoder wrong), `neither`.
    """
    n = both + fixed + broken + neither
    if n == 0:
        return -1.0, 1.0
    p1, p2 = (both + fixed) / n, (both + broken) / n
    l1, u1 = wilson_interval(both + fixed, n, z)
    l2, u2 = wilson_interval(both + broken, n, z)
    phi = _paired_phi(both, fixed, broken, neither)
    # max(0, .): with φ close to 1 rounding can make the sum of squares a hair negative.
    below = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    above = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return max(-1.0, p1 - p2 - below), min(1.0, p1 - p2 + above)


def _paired_phi(both: int, fixed: int, broken: int, neither: int) -> float:
    """φ of the paired 2x2 table with Newcombe's correction: a positive ad − bc shrinks by n/2 (never below 0), so
    a weak positive association does not narrow the interval; 0 when a margin is empty."""
    n = both + fixed + broken + neither
    margins = (both + fixed) * (broken + neither) * (both + broken) * (fixed + neither)
    if margins == 0:
        return 0.0
    association = both * neither - fixed * broken
    if association > 0:
        association = max(0.0, association - n / 2)
    return association / math.sqrt(margins)


def mcnemar_exact_p(fixed: int, broken: int) -> float:
    """Two-sided exact McNemar p-value: under no difference each discordant pair is a fair coin, so the smaller
    count is Binomial(fixed + broken, 1/2); the p-value doubles its lower tail (capped at 1; 1 with no discordant
    pairs). Exact integer arithmetic, so it holds for thousands of pairs."""
    m = fixed + broken
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, k) for k in range(min(fixed, broken) + 1))
    return min(1.0, 2 * tail / 2**m)


# --- the Pareto front -----------------------------------------------------------------------------------------------


def pareto_front(rows: list[dict]) -> list[dict]:
    """The rows no other row of the same checkpoint dominates, in their input order.

    One row dominates another when its accuracy is at least as high and its mean FPE at most as high, and it is
    strictly better in one of them: a decoder that matches another's accuracy at more compute is off the front.
    Rows tied on both stay on it together. Point estimates only: the intervals are in the tables.
    """
    rows = [r for r in rows if r["accuracy"] is not None]  # a row with no examples has no place on the front
    return [r for r in rows if not any(dominates(o, r) for o in rows if o["checkpoint"] == r["checkpoint"])]


def dominates(a: dict, b: dict) -> bool:
    no_worse = a["accuracy"] >= b["accuracy"] and a["mean_fpe"] <= b["mean_fpe"]
    return no_worse and (a["accuracy"] > b["accuracy"] or a["mean_fpe"] < b["mean_fpe"])


def quantiles(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"count": 0}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"count": len(ordered), "mean": sum(ordered) / len(ordered), "p10": pick(0.1), "p50": pick(0.5),
            "p90": pick(0.9)}
