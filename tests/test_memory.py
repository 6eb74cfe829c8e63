"""Memory bounds: the harvest streams its rows into shards, so its peak memory does not grow with harvest.n."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Heavy rows (32 tokens with a top-32 each): held in memory as Python lists, 512 of them take tens of MB.
HEAVY = ["harvest.shard_rows=16", "harvest.batch_size=16", "sampling.max_new_tokens=32", "sampling.temperature=1.0",
         "redumix.reflection_max_tokens=8", "redumix.topk=32"]


def _peak(run_dir: Path, model_dir: Path, n: int) -> float:
    recipe = str(ROOT / "recipes" / "tiny.yaml")
    command = [sys.executable, "-m", "redumix.pipeline.cli", "harvest", "--recipe", recipe,
               "--run-dir", str(run_dir), f"model.path={model_dir}", f"harvest.n={n}", *HEAVY]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
    return json.loads((run_dir / "harvest" / "manifest.json").read_text())["peak_rss_mb"]


@pytest.mark.slow
def test_harvest_peak_memory_does_not_grow_with_n(tmp_path, tiny_model_dir):
    """Measured per shard, the peak climbs over the first ~9 shards (allocator pools, the longest batch so far) and
    is then flat (513 MB at shard 3, 518 MB from shard 9 to 23 at n=384). Both sizes here are past that climb;
    holding the extra 480 rows would take about 35 MB more."""
    small = _peak(tmp_path / "small", tiny_model_dir, 160)
    large = _peak(tmp_path / "large", tiny_model_dir, 640)
    assert len(list((tmp_path / "large" / "harvest").glob("shard-*.arrow"))) == 40
    assert large - small < 12, (small, large)
