"""`redumix ablation` on a tiny random model: the arms follow from the recipe's policy, share round 1's harvest, and
each trains what it says."""

from __future__ import annotations

import json
from pathlib import Path

from redumix.pipeline.config import load_config
from redumix.pipeline.run import RunDir, arm_dir
from redumix.pipeline.studies.ablation import OLD_POLICY, ablation_arms, ablation_markdown, run_ablation
from redumix.pipeline.studies.rounds import round_dir
from tests.test_rounds import SMALL

ROOT = Path(__file__).resolve().parents[1]
POLICY = ["train.skill_rows=true", "train.replay=0.25", "rounds.restart=start"]


def test_the_arms_are_the_policy_each_ingredient_off_and_the_old_policy():
    config = load_config(ROOT / "recipes" / "tiny.yaml", [*POLICY, "rounds.ablation_seeds=[3,4]"])
    arms = ablation_arms(config)
    assert [(arm, seed) for arm, _, seed in arms] == [
        ("policy", 3), ("without-skill-rows", 3), ("without-replay", 3), ("without-restart", 3), ("old-policy", 3),
        ("old-policy-equal-steps", 3), ("policy", 4)]
    assert arms[1][1] == {"train.skill_rows": False} and arms[3][1] == {"rounds.restart": "last"}
    assert arms[4][1] == arms[5][1] == OLD_POLICY


def test_ablation_runs_every_arm_shares_round_one_and_reports(tmp_path, tiny_model_dir):
    config = load_config(ROOT / "recipes" / "tiny.yaml", [f"model.path={tiny_model_dir}", *SMALL, "rounds.count=1",
                                                          "rounds.ablation_seeds=[0]", "train.skill_rows=true",
                                                          "train.replay=0.25"])
    run = RunDir(tmp_path / "run")
    summary = run_ablation(config, run)

    arms = [(row["arm"], row["seed"]) for row in summary["arms"]]
    assert arms == [("policy", 0), ("without-skill-rows", 0), ("without-replay", 0), ("old-policy", 0),
                    ("old-policy-equal-steps", 0)]
    assert all(row["done"] and row["steps"] > 0 and row["wall_seconds"] > 0 for row in summary["arms"])
    shards = {arm: sorted(round_dir(arm_dir(run.ablation, arm, 0), 1).harvest.glob("shard-*.arrow"))
              for arm, _ in arms}
    first = [p.read_bytes() for p in shards["policy"]]
    assert first and all([p.read_bytes() for p in paths] == first for paths in shards.values())

    def rows(arm: str) -> dict:
        metrics = round_dir(arm_dir(run.ablation, arm, 0), 1).train / "metrics.json"
        return json.loads(metrics.read_text())["rows"]

    assert "skill" in rows("policy") and "replay" in rows("policy")
    assert "skill" not in rows("without-skill-rows") and "replay" in rows("without-skill-rows")
    assert "skill" in rows("without-replay") and "replay" not in rows("without-replay")
    assert "skill" not in rows("old-policy") and "replay" not in rows("old-policy")
    assert summary["arms"][1]["greedy_vs_policy"] is not None and "greedy_vs_policy" not in summary["arms"][0]
    text = (run.root / "ablation" / "ablation.md").read_text()
    assert text == ablation_markdown(summary) and all(f"| {arm} | 0 |" in text for arm, _ in arms)
