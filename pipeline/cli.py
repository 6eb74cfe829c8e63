"""`redumix STAGE --recipe PATH [--run-dir DIR] [key.sub=value ...]`

Stages: base (build the embedded default model), harvest, train, eval, export (DPO pairs from the shards),
calibrate (the reflective gate's thresholds), rounds (harvest -> train -> eval again from each round's model),
evidence (the controls and ablations of the distillation claim).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from redumix.pipeline.config import Config, ConfigError, config_to_yaml, load_config
from redumix.pipeline.run import RunDir, atomic_write_text, print0, rank

STAGES = ("base", "harvest", "train", "eval", "export", "calibrate", "rounds", "evidence")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="redumix", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("stage", choices=STAGES)
    parser.add_argument("--recipe", default="recipes/tiny.yaml", help="YAML recipe (default: recipes/tiny.yaml)")
    parser.add_argument("--run-dir", default=None, help="run folder (default: runs/<recipe name>)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, applied after the recipe")
    return parser.parse_intermixed_args(argv)  # overrides may follow --recipe, as the Makefile passes them


def resolve(argv: list[str] | None = None) -> tuple[str, Config, RunDir]:
    args = parse_args(argv)
    config = load_config(args.recipe, args.overrides)
    run = RunDir(Path(args.run_dir) if args.run_dir else Path("runs") / config.name)
    return args.stage, config, run


def main(argv: list[str] | None = None) -> int:
    try:
        stage, config, run = resolve(argv)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"redumix: {exc}", file=sys.stderr)
        return 2
    try:
        if rank() == 0:
            run.root.mkdir(parents=True, exist_ok=True)
            atomic_write_text(run.config, config_to_yaml(config))
        print0(f"redumix {stage}: run folder {run.root}, recipe {config.name}")
        run_stage(stage, config, run)
    except PermissionError as exc:
        print(f"redumix {stage}: error: {permission_message(exc, run)}", file=sys.stderr)
        return 1
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"redumix {stage}: error: {exc}", file=sys.stderr)
        return 1
    return 0


def permission_message(exc: PermissionError, run: RunDir) -> str:
    """A refused read or write, with the path and what to do (a temporary file stands for its folder)."""
    path = Path(exc.filename) if exc.filename else run.root
    if path.name.startswith(".") and path.name.endswith(".tmp"):
        path = path.parent
    return (f"{path}: {exc.strerror or 'permission denied'}; give this user access to it (the run folder "
            f"{run.root} must be writable), or pass another --run-dir")


def run_stage(stage: str, config: Config, run: RunDir) -> None:
    # Imports are per stage so that `redumix base` does not pay for TRL and DeepSpeed.
    if stage == "base":
        from redumix.embedded.stage import run_base

        run_base(config, run)
    elif stage == "harvest":
        from redumix.pipeline.harvest import run_harvest

        run_harvest(config, run)
    elif stage == "train":
        from redumix.pipeline.train import run_train

        run_train(config, run)
    elif stage == "eval":
        from redumix.pipeline.eval import run_eval

        run_eval(config, run)
    elif stage == "export":
        from redumix.pipeline.export import run_export

        run_export(config, run)
    elif stage == "calibrate":
        from redumix.pipeline.calibrate import run_calibrate

        run_calibrate(config, run)
    elif stage == "rounds":
        from redumix.pipeline.rounds import run_rounds

        run_rounds(config, run)
    elif stage == "evidence":
        from redumix.pipeline.evidence import run_evidence

        run_evidence(config, run)


if __name__ == "__main__":
    sys.exit(main())
