"""bench/bench_decode.py's `round_robin`: every key gets its pairs, spread over the rounds, each pair's two sides
timed one right after the other."""

from __future__ import annotations

from bench.bench_decode import Pairs, round_robin
from redumix.pipeline.config import REPO, load_config


def test_round_robin_deals_each_key_its_pairs_over_the_rounds():
    calls: list[tuple[str, str]] = []

    def side(key: str, which: str, seconds: float):
        def call() -> float:
            calls.append((key, which))
            return seconds
        return call

    keys = {name: Pairs(side(name, "num", 2.0), side(name, "den", 1.0), pairs, warmed=name == "warm")
            for name, pairs in (("one", 1), ("three", 3), ("five", 5), ("warm", 2))}
    ratios = round_robin(keys, rounds=3, label="test")
    assert ratios == {"one": 2.0, "three": 2.0, "five": 2.0, "warm": 2.0}
    paired = calls[6:]  # after one warm-up pair of each key that is not warmed
    assert calls[:6] == [(k, w) for k in ("one", "three", "five") for w in ("num", "den")]
    numerators = [key for key, which in paired if which == "num"]
    assert [numerators.count(k) for k in ("one", "three", "five", "warm")] == [1, 3, 5, 2]
    assert all(which == "den" and key == paired[2 * i][0] for i, (key, which) in enumerate(paired[1::2]))
    # Round 1: one, three, five ×2, warm; round 2: three, five ×2, warm; round 3: three, five.
    assert numerators == ["one", "three", "five", "five", "warm", "three", "five", "five", "warm", "three", "five"]


def test_the_median_is_of_pair_ratios():
    # Pair ratios 4, 1, 2: median 2, where the ratio of medians is 4, of minimums 1, and the mean 7/3.
    numerator = iter([4.0, 1.0, 8.0]).__next__
    denominator = iter([1.0, 1.0, 4.0]).__next__
    assert round_robin({"k": Pairs(numerator, denominator, 3, warmed=True)}, rounds=1) == {"k": 2.0}


def test_teacher_signal_reads_the_right_result_of_the_line_a_sample_ends_on():
    from bench.teacher_signal import right_result

    assert right_result("4 + 9 = 13\n13 * 2 = ") == "26"
    assert right_result("20 - 23 = ") == "-3"
    assert right_result("4 + 9 = 13\n") is None and right_result("4 + 9 = 1") is None


def test_guide_signal_finds_no_disagreement_when_the_guide_is_the_small_model(capsys, monkeypatch):
    """bench/guide_signal.py on the shipped base as both models: the guide is right exactly where the small model is,
    and every threshold's shares are read from the same results."""
    from bench import guide_signal

    base = str(REPO / "models" / "tiny-base")
    monkeypatch.setattr("sys.argv", ["guide_signal", "--small", base, "--guide", base, "--rows", "40"])
    guide_signal.main()
    out = capsys.readouterr().out
    assert "the guide's argmax is right at 0.0% of those and 100.0% of the small model's right ones" in out
    assert out.count("\n| 0.") == len(guide_signal.THRESHOLDS)


def test_target_stability_reads_no_distance_where_the_target_is_the_model_under_x(tmp_path):
    """bench/target_stability.py on the shipped base: at λ=1 the stored target is the model's own p(· | x, y<t), so
    its KL from the model under x is zero up to the shards' float16 rounding; at λ=0 the target is p(· | x2, y<t),
    and the distance shows."""
    from bench import target_stability
    from redumix.pipeline.harvest import run_harvest
    from redumix.pipeline.run import RunDir

    base = REPO / "models" / "tiny-base"
    small = ["harvest.n=6", "harvest.shard_rows=3", "harvest.batch_size=3", "sampling.temperature=1.0",
             "redumix.topk=8"]
    folders = []
    for lam in ("1.0", "0.0"):
        config = load_config("tiny", [f"model.path={base}", f"redumix.lam={lam}", *small])
        run_harvest(config, RunDir(tmp_path / lam))
        folders.append(str(tmp_path / lam / "harvest"))
    summary = target_stability.main(["--model", str(base), "--harvest", *folders])
    at_one, at_zero = (summary[f] for f in folders)
    assert abs(at_one["kl"][0]) < 2e-3
    assert at_zero["kl"][1] > 0.01
    assert all(s["entropy"][0] > 0 for s in summary.values())
