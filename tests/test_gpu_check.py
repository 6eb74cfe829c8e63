"""bench/gpu_check.py's comparisons: where two runs' ids part, and how far their stored log-probs lie apart."""

from __future__ import annotations

import sys

import pytest

from bench.gpu_check import Row, compare_ids, first_difference, logprob_gaps, table
from bench.harvest_vs_hf import Redo


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
    text = table([Row("harvest", "m", "cpu", "ids equal on 1/2", False), Row("throughput", "m", "cpu", "x", None)])
    assert "| harvest | m | cpu | ids equal on 1/2 | FAILED |" in text and text.endswith("| x | – |")


def test_the_vllm_row_says_it_was_skipped_where_vllm_does_not_import(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.gpu_check import SMOKE, check_vllm_engine

    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` meets where it is not installed
    [row] = check_vllm_engine("cpu", SMOKE)
    assert row.ok is None and row.result.startswith("skipped: vLLM does not import here")
    assert "make vllm" in row.result
