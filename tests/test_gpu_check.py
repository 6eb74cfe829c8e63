"""bench/gpu_check.py's comparisons (where two runs' ids part, how far their stored log-probs lie apart) and its
runner (bench/gpu_rows.py): each row written as soon as it is done, `--only`, and a budget past which no row starts."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from bench.gpu_check import Row, compare_ids, first_difference, logprob_gaps, main, table
from bench.gpu_rows import pick, run_checks
from bench.harvest_vs_hf import Redo
from redumix.common.files import read_json


def test_first_difference_and_compare_ids() -> None:
    assert first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one stopped early: they part where it stopped
    assert first_difference([5], [5]) == 1
    equal, text = compare_ids([[1, 2, 3], [1, 9], [4]], [[1, 2, 3], [1, 2], [5]])
    assert equal == 1 and text == "ids equal on 1/3; the others first differ at token 0.5 (median)"


def redo(ids: list[int], topk: list[list[tuple[int, float]]]) -> Redo:
    return Redo([], ids, [[i for i, _ in row] for row in topk], [[lp for _, lp in row] for row in topk], [])


def test_logprob_gaps_cover_the_shared_prefix_and_the_shared_topk_only() -> None:
    ours = redo([7, 8, 9], [[(7, -0.1), (3, -2.5)], [(8, -0.2), (4, -12.0)], [(9, -0.3)]])
    reference = redo([7, 8, 5], [[(7, -0.15), (3, -2.0), (6, -4.0)], [(8, -0.2), (4, -11.0)], [(5, -0.1)]])
    # Position 2 differs, so only 0 and 1 count; id 6 is in one top-k only; id 4 lies below the -10 floor.
    assert logprob_gaps([ours], [reference]) == pytest.approx([0.05, 0.5, 0.0])


def test_the_table_marks_failures() -> None:
    rows = [Row("harvest", "m", "cpu", "ids equal on 1/2", False), Row("throughput", "m", "cpu", "x", None, 3.2)]
    text = table(rows)
    assert "| harvest | m | cpu | ids equal on 1/2 | FAILED |  |" in text and text.endswith("| x | – | 3 |")


def test_the_vllm_row_says_it_was_skipped_where_vllm_does_not_import(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.gpu_check import SMOKE, check_vllm_engine

    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` meets where it is not installed
    [row] = check_vllm_engine("cpu", SMOKE)
    assert row.ok is None and row.result.startswith("skipped: vLLM does not import here")
    assert "make vllm" in row.result


def test_each_row_is_written_to_the_json_as_soon_as_it_is_done(tmp_path, capsys) -> None:
    path = tmp_path / "rows.json"

    def first() -> Iterator[Row]:
        yield Row("first", "m", "cpu", "a", True)
        assert [r["result"] for r in read_json(path)] == ["a"]  # written before the next row starts
        yield Row("first", "m", "cpu", "b", None)

    def second() -> list[Row]:
        assert [r["result"] for r in read_json(path)] == ["a", "b"]
        return [Row("second", "m", "cpu", "c", False)]

    rows = run_checks({"first": first, "second": second}, json_path=path)
    assert [r.result for r in rows] == ["a", "b", "c"] and read_json(path)[-1]["ok"] is False
    assert capsys.readouterr().out.count("| first | m | cpu |") == 2  # each row printed as it came


def test_a_budget_starts_no_row_past_it_and_says_which_checks_it_skipped(tmp_path) -> None:
    now = iter(range(0, 1000, 10))  # every look at the clock is 10 s later
    started = []

    def check(name: str):
        def rows() -> Iterator[Row]:
            for i in range(3):
                started.append(f"{name}{i}")
                yield Row(name, "m", "cpu", str(i), None)
        return rows

    checks = {"a": check("a"), "b": check("b"), "c": check("c")}
    rows = run_checks(checks, budget_s=45, json_path=tmp_path / "rows.json", clock=lambda: next(now))
    assert started == ["a0", "a1"]  # the third row of a would start past 45 s
    skipped = [r for r in rows if r.result.startswith("skipped")]
    assert [r.check for r in skipped] == ["a", "b", "c"]
    assert "past the budget of 45 s" in skipped[0].result
    assert len(read_json(tmp_path / "rows.json")) == 5


def test_only_runs_the_named_checks_in_the_table_order_and_refuses_unknown_ones() -> None:
    checks = {name: (lambda: []) for name in ("decoders", "static", "step")}
    assert list(pick(checks, "step,decoders")) == ["decoders", "step"]
    assert list(pick(checks, None)) == ["decoders", "static", "step"]
    with pytest.raises(SystemExit, match="unknown check nope; known: decoders, static, step"):
        pick(checks, "static,nope")


def test_the_command_line_takes_only_and_budget(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)
    path = tmp_path / "rows.json"
    [row] = main(["--device", "cpu", "--only", "vllm", "--budget-s", "1000", "--json", str(path)])
    assert row.result.startswith("skipped: vLLM does not import here") and read_json(path) == [row.__dict__]
    rows = main(["--device", "cpu", "--only", "vllm,lora", "--budget-s", "0", "--json", str(path)])
    assert [r.check for r in rows] == ["lora", "vllm"]  # the table's order, and nothing run
    assert [r.result.split(",")[0] for r in rows] == ["skipped: 0 s had passed"] * 2
    assert read_json(path) == [r.__dict__ for r in rows]
