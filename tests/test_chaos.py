"""The chaos test: `harvest`, `train` and `eval` on the tiny recipe, each SIGKILLed again and again at random moments
and rerun with the same command, must end with the outputs of an unbroken run, having lost nothing and redone nothing
that was complete.

A kill lands at a moment drawn from the seed and placed by the stage's own recent pace, not by a fixed clock (on a
shared machine the same harvest took 8 s one time and 44 s the next). One kill in five falls anywhere in start-up
(the time until the CLI prints `redumix STAGE: run folder`, as long as it last took). The others fall, with even odds,
after that line, a uniform fraction of the time the stage last took from it to a unit of work (a shard, a checkpoint,
an eval record; once every unit is done, to its end), or after the attempt's first new unit, a uniform fraction of
the time the stage last took from one unit to the next; each window is scaled by the attempt's own pace so far (its
start-up, or its time to that first unit, against the last ones seen). So kills land in start-up, in a stage's set-up
(the base's copy, loading the model), in the middle of a shard, a checkpoint or a record, in an atomic write, in the
merge and in the final report, and a kill moves the work on by under a unit on average. Once a stage has no more
units left than kills it still owes, its kills fall before its next unit, so each stage lands its quota. Each stage
is killed KILLS_PER_STAGE times (plus the kills an earlier stage did not land), or until its completion marker is
written, and then runs to its end; a kill drawn after the attempt's end is no kill.

What is checked, besides the end state (shard rows, the manifest, train's metrics and weights, eval's report rows):
- each rerun resumes from what was on disk at the kill: the harvest counts the shards that were there, train
  resumes from the newest complete checkpoint, and a finished stage says it is complete;
- work complete at a kill is never redone: every shard on disk at a kill keeps its inode and mtime to the end, and
  every eval record on disk at a kill is in the final records unchanged (its own `seconds` included);
- no temporary file (`.*.tmp`, `*.partial`) is left, the lock is free and its holder note gone, and every JSON file
  of the run folder, the metrics log of the killed runs included, is strict JSON.

Floats: token ids and text must match exactly, stored log-probs and losses to 1e-4 (a resumed run is another process,
and its float sums may differ in the last bits). Replay a run with REDUMIX_CHAOS_SEED=S (the seed is printed first).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from safetensors.torch import load_file

from redumix.data.shards import iter_rows, shard_paths
from redumix.pipeline.lock import HOLDER_NAME, LOCK_NAME
from redumix.pipeline.run import RunDir
from redumix.pipeline.train import last_complete_checkpoint

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny.yaml"
STAGES = ("harvest", "train", "eval")
KILLS_PER_STAGE = 8
START_UP_SHARE = 0.2  # of the kills, drawn in start-up
MAX_STEPS = 7
UNITS = {"harvest": 6, "train": MAX_STEPS - 1, "eval": 3 * 4}  # shards; checkpoints (none at the last step); records
SETTINGS = ["harvest.n=6", "harvest.shard_rows=1", "harvest.batch_size=1", "sampling.max_new_tokens=12",
            "redumix.reflection_max_tokens=8", f"train.max_steps={MAX_STEPS}", "train.save_steps=1",
            "train.batch_size=4", "train.logging_steps=1", "eval.n=4", "eval.n_other=4", "eval.batch_size=1",
            "eval.decoders=[greedy, redumix-oracle]", "eval.tuned_decoders=[greedy]"]
MARKERS = {"harvest": "harvest/manifest.json", "train": "train/metrics.json", "eval": "eval/report.json"}
# The lines by which a stage says how it resumes; an attempt shows one of them once it has decided.
RESUME_LINES = {"harvest": ("harvest: resuming", "harvest: complete"),
                "train": ("train: resuming from", "train: already complete"), "eval": ("eval: complete",)}
TOLERANCE = 1e-4
TIMES = {"seconds", "decode_seconds", "examples_per_s", "peak_rss_mb", "wall_seconds", "seconds_per_step", "wall_s",
         "tokens_per_s"}


@dataclass
class Kill:
    stage: str
    attempt: int
    at: float  # seconds after the process started
    point: str  # what was on disk when it died


@dataclass
class Attempt:
    code: int | None  # None: killed
    seconds: float
    startup: float | None  # seconds until `redumix STAGE: run folder`; None if it never got there
    to_unit: float | None  # seconds from that line to its first new unit of work (or to its end); None: not reached
    unit_gap: float | None  # seconds from its first new unit to its second; None: not reached
    final: float | None  # seconds from its last new unit to its end; None: it was killed, or wrote no unit
    output: str


@dataclass
class Chaos:
    """The killed run's folder and the bookkeeping of every kill."""

    run: RunDir
    logs: Path
    seed: int
    rng: random.Random
    startup: float = 8.0  # the last start-up seen
    to_unit: dict[str, float] = field(default_factory=dict)  # per stage: the last time from start-up to a unit
    unit_gap: dict[str, float] = field(default_factory=dict)  # per stage: the last time from one unit to the next
    final: dict[str, float] = field(default_factory=dict)  # per stage: the last time from its last unit to its end
    kills: list[Kill] = field(default_factory=list)
    shards_seen: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (inode, mtime) at a kill
    records_seen: dict[tuple[str, str], dict] = field(default_factory=dict)  # (file, id) -> record at a kill


# --- what is on disk ------------------------------------------------------------------------------------------------


def shards_on_disk(run: RunDir) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(run.harvest.glob("shard-*.arrow"))}


def records_on_disk(run: RunDir) -> dict[tuple[str, str], dict]:
    found = {}
    for path in sorted((run.eval / "generations").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            found[(path.name, record["id"])] = record
    return found


def newest_checkpoint(run: RunDir) -> str | None:
    return last_complete_checkpoint(run.train / "checkpoints")


def units_done(run: RunDir, stage: str) -> int:
    """The stage's units of work on disk: shards, the newest complete checkpoint's step, eval records."""
    if stage == "harvest":
        return len(shards_on_disk(run))
    if stage == "train":
        newest = newest_checkpoint(run)
        return int(newest.rpartition("-")[2]) if newest else 0
    return len(records_on_disk(run))


def describe(run: RunDir, stage: str, started: bool) -> str:
    where = "" if started else "in start-up; "
    if stage == "harvest":
        base = "base copied" if (run.embedded / "config.json").is_file() else "no base yet"
        complete = ", manifest written" if (run.harvest / "manifest.json").is_file() else ""
        return f"{where}{base}, {units_done(run, stage)}/{UNITS[stage]} shards{complete}"
    if stage == "train":
        merged = ", merged" if (run.train / "merged" / "config.json").is_file() else ""
        complete = ", metrics.json written" if (run.train / "metrics.json").is_file() else ""
        return f"{where}{units_done(run, stage)}/{UNITS[stage]} checkpoints{merged}{complete}"
    complete = ", report.json written" if (run.eval / "report.json").is_file() else ""
    return f"{where}{units_done(run, stage)}/{UNITS[stage]} records{complete}"


def expected_resume(run: RunDir, stage: str) -> str | None:
    """The line the next attempt must print, given what is on disk now (None: nothing to resume from)."""
    if (run.root / MARKERS[stage]).is_file():
        return {"harvest": "harvest: complete", "train": "train: already complete", "eval": "eval: complete"}[stage]
    if stage == "harvest" and units_done(run, stage):
        return f"harvest: resuming, {units_done(run, stage)} of {UNITS[stage]} shards already on disk"
    if stage == "train" and newest_checkpoint(run):
        return f"train: resuming from {newest_checkpoint(run)}"
    return None  # eval resumes silently: the records seen at each kill are checked at the end instead


# --- one attempt ----------------------------------------------------------------------------------------------------


def attempt(run: RunDir, log: Path, stage: str, kill: KillAt | None = None) -> Attempt:
    """Run the stage's command, and SIGKILL it at `kill` if it still runs then."""
    command = [sys.executable, "-m", "redumix.pipeline.cli", stage, "--recipe", str(RECIPE), "--run-dir",
               str(run.root), *SETTINGS]
    ready, seen = f"redumix {stage}: run folder", units_done(run, stage)
    startup = to_unit = second = last = None
    with open(log, "w") as out:
        began = time.monotonic()
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        while True:
            code = process.poll()
            now = time.monotonic() - began
            if startup is None and ready in log.read_text(errors="replace"):
                startup = now
            elif startup is not None:  # the first new unit (or the end), the second, the last
                done = units_done(run, stage)
                if done > seen:
                    last = now - startup
                if to_unit is None and (code is not None or done > seen):
                    to_unit = now - startup
                elif second is None and done > seen:
                    second = now - startup
                seen = max(seen, done)
            if code is not None:
                break
            if kill is not None and (due := kill.due(startup, to_unit)) is not None and now >= due:
                process.send_signal(signal.SIGKILL)
                process.wait()
                code = None
                break
            if now > 600:
                process.kill()
                pytest.fail(f"{log.name}: ran past 10 minutes")
            time.sleep(0.05)
    unit_gap = None if second is None else second - to_unit
    final = None if code is None or last is None else now - startup - last
    return Attempt(code, now, startup, to_unit, unit_gap, final, log.read_text(errors="replace"))


@dataclass
class KillAt:
    """When to kill an attempt: `fraction` of a `window` (seconds the stage last took for that stretch) after an
    anchor: the start, the run-folder line, or the first new unit of work. The last two scale the window by this
    attempt's pace so far against `reference` (its start-up, or its time to that unit, against the last seen)."""

    anchor: str  # "start", "ready" or "unit"
    fraction: float
    window: float
    reference: float = 1.0

    def due(self, startup: float | None, to_unit: float | None) -> float | None:
        """Seconds after the start, once the attempt has got far enough to say."""
        if self.anchor == "start":
            return self.fraction * self.window
        if startup is None or (self.anchor == "unit" and to_unit is None):
            return None
        if self.anchor == "ready":
            return startup + self.fraction * self.window * startup / self.reference
        return startup + to_unit + self.fraction * self.window * to_unit / self.reference


def kill_moment(chaos: Chaos, stage: str, owed: int) -> KillAt:
    """In start-up (one kill in five); else, with even odds, after the run-folder line within the time the stage last
    took from it to a unit of work, or after the first new unit within the time it last took from one unit to the
    next (each at this attempt's pace)."""
    fraction = chaos.rng.random()
    if chaos.rng.random() < START_UP_SHARE:
        return KillAt("start", fraction, chaos.startup)
    left = UNITS[stage] - units_done(chaos.run, stage)
    if left == 0:  # set-up, then the final writes
        return KillAt("ready", fraction, chaos.to_unit[stage] + chaos.final[stage], chaos.startup)
    # A kill after a new unit moves the stage on; once the units left are no more than the kills it still owes, such
    # kills would end the stage short of its quota (CI once landed 19 of 24), so kills fall before the next unit.
    if owed >= left or chaos.rng.random() < 0.5:
        return KillAt("ready", fraction, chaos.to_unit[stage], chaos.startup)
    return KillAt("unit", fraction, chaos.unit_gap[stage], chaos.to_unit[stage])


def check_resume(chaos: Chaos, stage: str, number: int, expect: str | None, finished: bool, output: str) -> None:
    """The attempt resumed from what the last kill left: it printed `expect` (once it had decided how to resume, or
    by its end), or no resume line at all when there was nothing to resume."""
    shown = [line for line in RESUME_LINES[stage] if line in output]
    where = f"seed {chaos.seed}: {stage} attempt {number}"
    if expect is None:
        assert not shown, f"{where} resumed ({shown}) with nothing on disk to resume from:\n{output[-3000:]}"
    elif shown or finished:
        assert expect in output, f"{where} did not resume with {expect!r}:\n{output[-3000:]}"


def run_stage_with_kills(chaos: Chaos, stage: str, quota: int) -> None:
    """Kill the stage `quota` times at drawn moments (fewer if it ends first), then let it finish; after each kill,
    the next attempt must resume from what the kill left."""
    kills, number, expect = 0, 0, None
    while True:
        number += 1
        complete = (chaos.run.root / MARKERS[stage]).is_file()
        kill = kill_moment(chaos, stage, quota - kills) if kills < quota and not complete else None
        run = attempt(chaos.run, chaos.logs / f"{stage}-{number:02d}.out", stage, kill)
        if run.startup is not None:
            chaos.startup = run.startup
        if run.to_unit is not None:
            chaos.to_unit[stage] = run.to_unit
        if run.unit_gap is not None:
            chaos.unit_gap[stage] = run.unit_gap
        if run.final is not None:
            chaos.final[stage] = run.final
        check_resume(chaos, stage, number, expect, run.code is not None, run.output)
        if run.code is not None:
            assert run.code == 0, f"seed {chaos.seed}: {stage} attempt {number} exited {run.code}:\n" + run.output
            return
        kills += 1
        chaos.kills.append(Kill(stage, number, run.seconds, describe(chaos.run, stage, run.startup is not None)))
        after = f" ({run.seconds - run.startup:4.1f} s after start-up)" if run.startup is not None else ""
        print(f"chaos: kill {len(chaos.kills):2d}: {stage} attempt {number} at {run.seconds:5.1f} s{after}, drawn "
              f"from its {kill.anchor}: {chaos.kills[-1].point}", flush=True)
        chaos.shards_seen.update(shards_on_disk(chaos.run))
        chaos.records_seen.update(records_on_disk(chaos.run))
        expect = expected_resume(chaos.run, stage)


# --- comparing outputs ----------------------------------------------------------------------------------------------


def close(a: object, b: object, path: str = "") -> list[str]:
    """Where two JSON-like values differ: ids, text, counts and flags exactly; floats to TOLERANCE."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a for d in close(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} != {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in close(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        same = math.isclose(a, b, abs_tol=TOLERANCE) or (math.isinf(a) and a == b)
        return [] if same else [f"{path}: {a} != {b}"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def without_times(value: object) -> object:
    if isinstance(value, dict):
        return {k: without_times(v) for k, v in value.items() if k not in TIMES}
    if isinstance(value, list):
        return [without_times(v) for v in value]
    return value


def harvest_rows(run: RunDir) -> list[dict]:
    rows = []
    for row in iter_rows(shard_paths(run.harvest)):
        meta = json.loads(row["meta"])
        meta.pop("model")  # the run folder's own base/ path
        rows.append(without_times({**row, "meta": meta}))
    return rows


def manifest(run: RunDir) -> dict:
    """The manifest without its times, and each shard's rows without its bytes (a row's meta holds its seconds)."""
    found = without_times(json.loads((run.harvest / "manifest.json").read_text()))
    found["shard_files"] = {name: entry["rows"] for name, entry in found["shard_files"].items()}
    found.pop("shard_bytes")
    return found


def train_metrics(run: RunDir) -> dict:
    found = without_times(json.loads((run.train / "metrics.json").read_text()))
    found["inputs"].pop("harvest")  # the manifest's hash, which holds the shards' (see above)
    return found


def report_rows(run: RunDir) -> list[dict]:
    return without_times(json.loads((run.eval / "report.json").read_text())["rows"])


def strict(text: str, where: str) -> object:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{where} holds {constant}, which is not JSON")

    return json.loads(text, parse_constant=refuse)


# --- the test -------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_chaos_kills_lose_nothing_and_redo_nothing(tmp_path):
    seed = int(os.environ.get("REDUMIX_CHAOS_SEED", random.SystemRandom().randrange(10**6)))
    print(f"\nchaos: seed {seed} (replay: REDUMIX_CHAOS_SEED={seed})", flush=True)
    began = time.monotonic()

    # The unbroken run, by the same commands.
    whole, logs = RunDir(tmp_path / "whole"), tmp_path / "logs"
    logs.mkdir()
    to_unit, unit_gap, final = {}, {}, {}
    for stage in STAGES:
        run = attempt(whole, logs / f"whole-{stage}.out", stage)
        assert run.code == 0, run.output
        to_unit[stage], unit_gap[stage], final[stage] = run.to_unit, run.unit_gap, run.final
        print(f"chaos: unbroken {stage}: {run.seconds:.1f} s: start-up {run.startup:.1f} s, {run.to_unit:.1f} s more "
              f"to its first unit of work, {run.unit_gap:.1f} s to the next, {run.final:.1f} s of final writes",
              flush=True)

    chaos = Chaos(RunDir(tmp_path / "chaos"), logs, seed, random.Random(seed), to_unit=to_unit, unit_gap=unit_gap,
                  final=final)
    for index, stage in enumerate(STAGES):
        run_stage_with_kills(chaos, stage, quota=KILLS_PER_STAGE * (index + 1) - len(chaos.kills))
    run = chaos.run
    per_stage = {stage: sum(k.stage == stage for k in chaos.kills) for stage in STAGES}
    swept = sum(int(m) for log in logs.glob("*.out") for m in re.findall(r"removed (\d+) temporary", log.read_text()))
    print(f"chaos: seed {seed}, {len(chaos.kills)} kills ({', '.join(f'{s} {n}' for s, n in per_stage.items())}) "
          f"in {time.monotonic() - began:.0f} s; the reruns removed {swept} temporary file(s) that kills left",
          flush=True)
    assert len(chaos.kills) >= 20, f"seed {seed}: only {len(chaos.kills)} kills landed"

    # The end state is the unbroken run's.
    assert close(harvest_rows(run), harvest_rows(whole)) == [], f"seed {seed}: shard rows differ"
    assert close(manifest(run), manifest(whole)) == [], f"seed {seed}: manifests differ"
    assert close(train_metrics(run), train_metrics(whole)) == [], f"seed {seed}: train metrics differ"
    weights = [load_file(str(r.train / "merged" / "model.safetensors")) for r in (run, whole)]
    assert all(torch.allclose(weights[0][k], weights[1][k], atol=TOLERANCE) for k in weights[1]), f"seed {seed}"
    assert close(report_rows(run), report_rows(whole)) == [], f"seed {seed}: eval report rows differ"

    # Nothing complete was redone: the shards and records seen at any kill are the ones at the end.
    assert {n: s for n, s in shards_on_disk(run).items() if n in chaos.shards_seen} == chaos.shards_seen, seed
    final = records_on_disk(run)
    assert all(final[key] == record for key, record in chaos.records_seen.items()), f"seed {seed}: a record redone"

    # No temporary file left, the lock free, and every JSON file strict.
    left = [str(p) for p in run.root.rglob("*") if (p.name.startswith(".") and p.name.endswith(".tmp"))
            or p.name.endswith(".partial")]
    assert left == [], f"seed {seed}: temporary files left: {left}"
    assert not (run.root / HOLDER_NAME).exists(), f"seed {seed}: the lock's holder note is left"
    lock = FileLock(str(run.root / LOCK_NAME))
    lock.acquire(timeout=0)  # raises if a process still held it
    lock.release()
    for path in run.root.rglob("*.json*"):
        if path.suffix == ".json":
            strict(path.read_text(), str(path))
        elif path.suffix == ".jsonl":
            for number, line in enumerate(path.read_text().split("\n"), start=1):
                if line:
                    strict(line, f"{path}:{number}")
