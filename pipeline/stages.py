"""The stage table: every `redumix STAGE`, the module that runs it, and whether it runs on several ranks.

This file imports nothing but the standard library, so that it also runs as a script with any Python 3 (`python3
pipeline/stages.py --names`): the Makefile asks it for its targets before `.venv` exists and without paying for
torch and transformers on every `make`. `redumix stages` prints the same table for a user.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    module: str  # imported only when the stage runs, so that `redumix embedded` does not pay for TRL and DeepSpeed
    function: str  # its `(config, run)` entry point in that module
    help: str
    ranked: bool = False  # `make STAGE NPROC=N` launches it on N ranks through torchrun


STUDIES = "redumix.pipeline.studies"
STAGES: dict[str, Stage] = {
    "embedded": Stage("redumix.pipeline.embedded_stage", "run_embedded", "build the embedded default model"),
    "harvest": Stage("redumix.pipeline.harvest", "run_harvest", "redos under p_mix, into Arrow shards", ranked=True),
    "train": Stage("redumix.pipeline.train", "run_train", "distil the stored p_mix into the model", ranked=True),
    "eval": Stage("redumix.pipeline.eval", "run_eval", "every decoder on the base and tuned checkpoints", ranked=True),
    "export": Stage("redumix.pipeline.export", "run_export", "DPO pairs and an SFT set (JSONL, Parquet, datasets)"),
    # the studies (pipeline/studies/): they measure the product's stages and run them
    "calibrate": Stage(f"{STUDIES}.calibrate", "run_calibrate", "pick the reflective gate and stop rule"),
    "rounds": Stage(f"{STUDIES}.rounds", "run_rounds", "harvest, train, eval, round after round", ranked=True),
    "ablation": Stage(f"{STUDIES}.ablation", "run_ablation", "which ingredient of the round policy gains"),
    "evidence": Stage(f"{STUDIES}.evidence", "run_evidence", "controls and ablations of the distillation claim"),
    "ladder": Stage(f"{STUDIES}.ladder", "run_ladder", "does a redo beat a second sample (train problems)"),
}


def stages_text(which: str = "") -> str:
    """`--names`: the stage names on one line; `--ranked`: those that run on NPROC ranks; else the table."""
    if which == "--names":
        return " ".join(STAGES)
    if which == "--ranked":
        return " ".join(name for name, stage in STAGES.items() if stage.ranked)
    lines = [f"{name:<10} {stage.help}{'  [NPROC ranks]' if stage.ranked else ''}" for name, stage in STAGES.items()]
    return "\n".join(lines + ["", "[NPROC ranks]: `make STAGE NPROC=N` runs it on N processes through torchrun."])


def main(argv: list[str]) -> int:
    if argv not in ([], ["--names"], ["--ranked"]):
        print("usage: redumix stages [--names | --ranked]", file=sys.stderr)
        return 2
    print(stages_text(*argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
