"""The eval report's comparison with greedy: the paired interval against a published example, its degenerate tables,
the paired counts, the Pareto front, and that the Markdown and the plot carry them."""

from __future__ import annotations

import pytest

from redumix.pipeline.plot import n_caption, plot_accuracy_vs_fpe
from redumix.pipeline.report import paired_with_greedy, report_markdown, summarize, tuned_vs_base
from redumix.pipeline.stats import mcnemar_exact_p, newcombe_paired_interval, pareto_front, wilson_interval

# Cavo et al. (2012), complete response before/after consolidation therapy: the worked example of Fagerland,
# Lydersen & Laake, "Statistical Analysis of Contingency Tables" (2017), ch. 8, as printed by the authors' R package
# contingencytables (tests/testthat, chapter 8): table [[59, 6], [16, 80]], estimate -0.0621, Newcombe
# square-and-add 95% CI -0.1186 to -0.0046, McNemar exact conditional P = 0.052479.
CAVO = {"both": 59, "fixed": 6, "broken": 16, "neither": 80}


def record(example_id: str, correct: bool, fpe: float = 10.0) -> dict:
    return {"id": example_id, "correct": correct, "tokens": 5, "fpe": fpe, "prefill_tokens": 3, "seconds": 0.1,
            "extra": {}}


# --- the interval and the p-value ---------------------------------------------------------------------------------


def test_newcombe_interval_matches_the_published_worked_example():
    low, high = newcombe_paired_interval(**CAVO)
    assert low == pytest.approx(-0.1186, abs=5e-5)
    assert high == pytest.approx(-0.0046, abs=5e-5)
    # The correlation term matters here: without it (plain square-and-add) the interval would be wider.
    assert high - low < 0.12


def test_the_wilson_interval_holds_its_point_at_every_n():
    """At 0% and 100% a bound equals the point only in exact arithmetic: at 4 of 4 the upper bound came out
    0.9999999999999999, a hair below the point, and eval's plot refused the negative error bar. The tests had tried
    100% only at n = 3 and 2, where the rounding falls the safe way; this tries every count up to n = 400."""
    for n in range(1, 401):
        for k in range(n + 1):
            low, high = wilson_interval(k, n)
            assert 0.0 <= low <= k / n <= high <= 1.0, (k, n, low, high)


def test_newcombe_interval_is_antisymmetric_in_the_direction_of_the_comparison():
    low, high = newcombe_paired_interval(**CAVO)
    swapped = newcombe_paired_interval(CAVO["both"], CAVO["broken"], CAVO["fixed"], CAVO["neither"])
    assert swapped == pytest.approx((-high, -low), abs=1e-12)


@pytest.mark.parametrize(
    "table",
    [
        (50, 0, 0, 50),  # no discordant pairs
        (100, 0, 0, 0),  # all correct for both
        (0, 0, 0, 100),  # all wrong for both
        (1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1),  # n = 1
        (0, 7, 0, 0), (0, 0, 7, 0),  # every pair discordant, one way
        (3, 0, 0, 2), (400, 3, 1, 96),
    ],
)
def test_newcombe_interval_is_sane_on_degenerate_tables(table):
    both, fixed, broken, neither = table
    low, high = newcombe_paired_interval(both, fixed, broken, neither)
    estimate = (fixed - broken) / sum(table)
    assert -1.0 <= low <= estimate <= high <= 1.0
    assert low < high  # never a zero-width interval, not even with n = 1


def test_newcombe_interval_without_discordant_pairs_is_symmetric_around_zero():
    low, high = newcombe_paired_interval(50, 0, 0, 50)
    assert low == pytest.approx(-high) and 0 < high < 0.05
    assert newcombe_paired_interval(0, 0, 0, 0) == (-1.0, 1.0)  # no data: everything is possible


def test_mcnemar_exact_p_matches_the_published_example_and_edge_cases():
    assert mcnemar_exact_p(CAVO["fixed"], CAVO["broken"]) == pytest.approx(0.052479, abs=5e-7)
    assert mcnemar_exact_p(16, 6) == mcnemar_exact_p(6, 16)
    assert mcnemar_exact_p(0, 0) == 1.0
    assert mcnemar_exact_p(5, 5) == 1.0  # doubled tail is capped
    assert mcnemar_exact_p(0, 10) == pytest.approx(2 / 1024)
    assert 0.0 <= mcnemar_exact_p(480, 520) <= 1.0  # large counts stay exact, no overflow


# --- pairing with greedy ------------------------------------------------------------------------------------------


def greedy_and_decoder() -> tuple[list[dict], list[dict]]:
    """Greedy on 8 examples, a decoder on 5 of which one (x) greedy never saw: 4 pairs, 2 fixed, 1 broken."""
    greedy = [record("a", True, 10), record("b", True, 10), record("c", False, 10), record("d", False, 10)]
    greedy += [record(f"g{i}", True, 10) for i in range(4)]
    decoder = [record("a", True, 30), record("b", False, 30), record("c", True, 30), record("d", True, 30),
               record("x", False, 1000)]
    return greedy, decoder


def test_paired_counts_use_only_the_shared_examples():
    greedy, decoder = greedy_and_decoder()
    paired = paired_with_greedy(decoder, greedy)
    assert paired["paired_n"] == 4
    assert (paired["vs_greedy_fixed"], paired["vs_greedy_broken"]) == (2, 1)
    assert paired["vs_greedy"] == pytest.approx(0.25)
    assert paired["vs_greedy_low"] <= 0.25 <= paired["vs_greedy_high"]
    assert paired["mcnemar_p"] == pytest.approx(1.0)
    assert paired["fpe_vs_greedy"] == pytest.approx(3.0)  # x's 1000 FPE has no greedy partner and is left out


def test_summarize_adds_the_comparison_only_where_it_applies():
    greedy, decoder = greedy_and_decoder()
    row = summarize("base", "sample", decoder, greedy=greedy)
    assert row["n"] == 5 and row["paired_n"] == 4 and row["vs_greedy_fixed"] == 2
    assert "vs_greedy" not in summarize("base", "greedy", greedy, greedy=greedy)
    assert "vs_greedy" not in summarize("base", "sample", decoder)
    assert "vs_greedy" not in summarize("base", "sample", decoder, greedy=[])
    assert "vs_greedy" not in summarize("base", "sample", decoder, greedy=[record("elsewhere", True)])


# --- tuned against base -------------------------------------------------------------------------------------------


def test_tuned_vs_base_pairs_each_decoder_both_checkpoints_ran():
    greedy, decoder = greedy_and_decoder()
    records = {"base": {"greedy": greedy[:4], "moi": greedy[:4]},
               "tuned": {"greedy": decoder, "sample": decoder, "moi": greedy[:4]}}
    rows = tuned_vs_base(records)
    assert [r["decoder"] for r in rows] == ["greedy", "moi"]  # sample ran on tuned only
    first = rows[0]
    # the 4 shared examples: base right on a, b; tuned right on a, c, d -> fixed c, d; broke b
    assert (first["n"], first["fixed"], first["broken"]) == (4, 2, 1)
    assert (first["base_accuracy"], first["tuned_accuracy"]) == (0.5, 0.75)
    assert first["change"] == pytest.approx(0.25) and first["low"] <= 0.25 <= first["high"]
    assert first["mcnemar_p"] == pytest.approx(1.0) and first["fpe_vs_base"] == pytest.approx(3.0)
    assert rows[1]["change"] == 0 and rows[1]["mcnemar_p"] == 1.0
    assert tuned_vs_base({"base": records["base"]}) == []  # no tuned checkpoint: no table
    assert tuned_vs_base({"tuned": records["tuned"]}) == []

    report = {**report_with_pairs(), "tuned_vs_base": rows}
    markdown = report_markdown(report)
    assert "tuned vs base (paired)" in markdown
    lines = markdown.splitlines()
    line = next(x for x in lines if x.startswith("| greedy | 50.0% | 75.0% | +25.0 |"))
    assert "| 2 / 1 | 4 | 1 |" in line
    # right after the main table: before the details and the vs-greedy tables
    assert lines.index(line) < next(i for i, x in enumerate(lines) if x.startswith("vs greedy (paired)"))
    assert "tuned vs base" not in report_markdown(report_with_pairs())


# --- the Pareto front ---------------------------------------------------------------------------------------------


def row(checkpoint: str, decoder: str, accuracy: float, fpe: float) -> dict:
    return {"checkpoint": checkpoint, "decoder": decoder, "accuracy": accuracy, "mean_fpe": fpe,
            "ci_low": max(0.0, accuracy - 0.05), "ci_high": min(1.0, accuracy + 0.05), "n": 100,
            "mean_tokens": 5.0, "prefill_tokens": 3.0, "wall_s": 1.0, "tokens_per_s": 5.0}


def decoders(rows: list[dict]) -> list[tuple[str, str]]:
    return [(r["checkpoint"], r["decoder"]) for r in rows]


def test_pareto_front_drops_dominated_decoders_per_checkpoint():
    rows = [
        row("base", "greedy", 0.40, 100),
        row("base", "sample", 0.35, 100),  # same cost, less accurate
        row("base", "pdr", 0.40, 500),  # same accuracy, more cost
        row("base", "redumix", 0.55, 300),
        row("base", "moi", 0.50, 400),  # beaten on both by redumix
        row("tuned", "greedy", 0.30, 90),  # worse than base greedy, but only its own checkpoint counts
        row("tuned", "sample", 0.70, 1000),
    ]
    assert decoders(pareto_front(rows)) == [
        ("base", "greedy"), ("base", "redumix"), ("tuned", "greedy"), ("tuned", "sample")
    ]


def test_pareto_front_keeps_exact_ties_together():
    rows = [row("base", "a", 0.5, 200), row("base", "b", 0.5, 200), row("base", "c", 0.4, 200)]
    assert decoders(pareto_front(rows)) == [("base", "a"), ("base", "b")]
    assert pareto_front([]) == []
    assert decoders(pareto_front([row("base", "only", 0.0, 1)])) == [("base", "only")]


# --- the Markdown and the plot ------------------------------------------------------------------------------------


def report_with_pairs() -> dict:
    greedy, decoder = greedy_and_decoder()
    rows = [summarize("base", "greedy", greedy, greedy=greedy), summarize("base", "sample", decoder, greedy=greedy)]
    return {"task": "toy", "split": "test", "rows": rows, "diagnostics": {}}


def test_markdown_has_the_paired_table_and_the_front():
    markdown = report_markdown(report_with_pairs())
    assert "| checkpoint | decoder | accuracy | 95% CI |" in markdown  # the existing table stays
    assert "vs greedy (paired)" in markdown and "Newcombe" in markdown
    sample_line = next(line for line in markdown.splitlines() if line.startswith("| base | sample | +25.0 |"))
    assert "| 2 / 1 | 4 |" in sample_line and "3.00×" in sample_line
    assert not any(line.startswith("| base | greedy | +") for line in markdown.splitlines())
    # greedy: 6/8 = 75% at 10 FPE; sample: 3/5 = 60% at 224 FPE, dominated.
    assert "- base: greedy\n" in markdown


def test_markdown_without_greedy_has_no_paired_table():
    _, decoder = greedy_and_decoder()
    report = {"task": "toy", "split": "test", "rows": [summarize("base", "sample", decoder)], "diagnostics": {}}
    markdown = report_markdown(report)
    assert "vs greedy (paired)" not in markdown and "- base: sample" in markdown


def test_plot_marks_the_front_and_is_written(tmp_path):
    rows = [row("base", "greedy", 0.40, 100), row("base", "pdr", 0.38, 500), row("base", "redumix", 0.55, 300),
            row("tuned", "greedy", 0.50, 90), row("tuned", "sample", 0.50, 90)]
    path = tmp_path / "eval" / "accuracy_vs_fpe.png"
    plot_accuracy_vs_fpe(rows, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_draws_decoders_at_0_and_100_percent(tmp_path):
    """Rows summarised from real records (not bounds made up around the point) at the first counts where the Wilson
    bound of 0% or 100% used to round inside its point."""
    rows = [summarize("base", f"{'right' if right else 'wrong'}-{n}", [record(f"e{i}", right) for i in range(n)])
            for n in (4, 10, 14) for right in (True, False)]
    path = tmp_path / "accuracy_vs_fpe.png"
    plot_accuracy_vs_fpe(rows, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_labels_never_overlap_each_other_or_a_point():
    """The crowd the issue names: redumix-oracle@0 / redumix-oracle / redumix-self at one cost, greedy and moi at one
    point, and base and tuned reflective side by side; every label finds a free place."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from redumix.pipeline.plot import _label_points, _overlap, _plot_checkpoint

    rows = [row("base", "greedy", 0.43, 41), row("base", "moi", 0.43, 41), row("base", "redumix-oracle", 0.86, 180),
            row("base", "redumix-oracle@0", 0.85, 178), row("base", "redumix-self", 0.84, 182),
            row("base", "reflective", 0.55, 105), row("tuned", "reflective", 0.55, 100),
            row("tuned", "greedy", 0.63, 41), row("tuned", "moi", 0.63, 41.5)]
    fig, ax = plt.subplots(figsize=(10, 6), dpi=120)
    colors = {"base": "C0", "tuned": "C1"}
    for checkpoint, color in colors.items():
        _plot_checkpoint(ax, [r for r in rows if r["checkpoint"] == checkpoint], checkpoint, color, "o")
    ax.set_xscale("log")
    fig.tight_layout()
    boxes = _label_points(fig, ax, rows, colors)
    texts = [t.get_text() for t in ax.texts]
    plt.close(fig)
    assert sorted(texts) == sorted(r["decoder"] for r in rows)  # one label a point, the tried places removed
    for i, a in enumerate(boxes):
        assert all(_overlap(a, b) == 0 for b in boxes[i + 1 :]), rows[i]["decoder"]


def test_the_caption_gives_n():
    rows = [{**row("base", "greedy", 0.4, 41), "n": 1000}, row("base", "moi", 0.4, 41), row("base", "sr", 0.4, 41)]
    assert n_caption(rows) == "n = 1000 for greedy; 100 for each other decoder (examples per checkpoint)"
    assert n_caption(rows[1:]) == "n = 100 examples per decoder and checkpoint"
