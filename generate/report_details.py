"""What a decoder's per-record `extra` adds to its row in eval's report, declared once per kind of decoder and named by
its line in the decoder table (pipeline/decoders.py): a new decoder's details reach the report without an edit to
pipeline/report.py.

`summarize(records, n, tokens)` turns the records of a run (each with its `correct` and `extra`; with their count and
visible tokens) into the row's keys; `describe(row)` turns a row holding them into the Markdown's one-line details.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReportDetails:
    summarize: Callable[[list[dict[str, Any]], int, int], dict[str, Any]]  # (records, n, tokens) -> keys
    describe: Callable[[dict[str, Any]], str]


def _redo_summary(records: list[dict], n: int, tokens: int) -> dict[str, Any]:
    """A redo against its own first attempt."""
    return {"fixed": sum(r["correct"] and not r["extra"]["original_correct"] for r in records),
            "broken": sum(r["extra"]["original_correct"] and not r["correct"] for r in records)}


REDO = ReportDetails(_redo_summary,
                     lambda r: f"fixed {r['fixed']}, broke {r['broken']} (vs. its own first attempt)")


def _rounds_summary(records: list[dict], n: int, tokens: int) -> dict[str, Any]:
    extras = [r["extra"] for r in records]
    per_round = [x["tokens_per_round"] for x in extras]
    return {"longest_context": max((x["longest_context"] for x in extras), default=0),
            "tokens_per_round": [sum(x) / len(per_round) for x in zip(*per_round, strict=True)] if per_round else []}


REFINE = ReportDetails(
    _rounds_summary,
    lambda r: (f"tokens per round [{', '.join(f'{t:.0f}' for t in r['tokens_per_round'])}], longest context "
               f"{r['longest_context']}"),
)


def _reflection_summary(records: list[dict], n: int, tokens: int) -> dict[str, Any]:
    extras = [r["extra"] for r in records]
    return {"reflections_per_example": sum(x["n_reflections"] for x in extras) / max(n, 1),
            "hidden_tokens_per_example": sum(x["hidden_tokens"] for x in extras) / max(n, 1)}


REFLECTION = ReportDetails(
    _reflection_summary,
    lambda r: (f"{r['reflections_per_example']:.2f} reflections and {r['hidden_tokens_per_example']:.1f} hidden "
               "tokens per example"),
)


def _guide_summary(records: list[dict], n: int, tokens: int) -> dict[str, Any]:
    """Two models: each one's share, per example."""
    extras = [r["extra"] for r in records]
    row = {key: sum(x[key] for x in extras) / max(n, 1) for key in ("fpe_small", "fpe_guide", "tokens_small",
                                                                     "tokens_guide")}
    row["guide_share"] = sum(x["tokens_guide"] for x in extras) / max(1, tokens)
    row["guide_steps_per_example"] = sum(x["guide_steps"] for x in extras) / max(n, 1)
    row["delimiter_points_per_example"] = sum(x["delimiter_points"] for x in extras) / max(n, 1)
    return row


GUIDE = ReportDetails(
    _guide_summary,
    lambda r: (f"FPE small {r['fpe_small']:.0f} + guide {r['fpe_guide']:.0f}; tokens small {r['tokens_small']:.1f} "
               f"+ guide {r['tokens_guide']:.1f} (guide share {r['guide_share']:.1%}); "
               f"{r['guide_steps_per_example']:.2f} guide steps at {r['delimiter_points_per_example']:.2f} delimiter "
               "points per example"),
)
