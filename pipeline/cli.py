"""`redumix STAGE --recipe PATH [--run-dir DIR] [key.sub=value ...]`

The stages are the `STAGES` table below; `redumix --help` lists them. A new stage is a module with a
`run_<stage>(config, run)` function and one line there (and the Makefile's STAGES list, which a test compares).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from redumix.pipeline.config import Config, load_config
from redumix.pipeline.lock import RunFolderBusy, run_folder_lock
from redumix.pipeline.resolve import ConfigError, config_to_yaml
from redumix.pipeline.run import RunDir, atomic_write_text, print0, rank


@dataclass(frozen=True)
class Stage:
    module: str  # imported only when the stage runs, so that `redumix base` does not pay for TRL and DeepSpeed
    function: str  # its `(config, run)` entry point in that module
    help: str
    ranked: bool = False  # `make STAGE NPROC=N` launches it on N ranks through torchrun


# One line a stage: the Makefile reads its targets from these lines, so keep each entry on one line.
STAGES: dict[str, Stage] = {
    "base": Stage("redumix.embedded.stage", "run_base", "build the embedded default model"),
    "harvest": Stage("redumix.pipeline.harvest", "run_harvest", "redos under p_mix, into Arrow shards", ranked=True),
    "train": Stage("redumix.pipeline.train", "run_train", "distil the stored p_mix into the model", ranked=True),
    "eval": Stage("redumix.pipeline.eval", "run_eval", "every decoder on the base and tuned checkpoints", ranked=True),
    "export": Stage("redumix.pipeline.export", "run_export", "DPO pairs from the harvest's shards"),
    "calibrate": Stage("redumix.pipeline.calibrate", "run_calibrate", "pick the reflective gate and stop rule"),
    "rounds": Stage("redumix.pipeline.rounds", "run_rounds", "harvest, train, eval, round after round", ranked=True),
    "evidence": Stage("redumix.pipeline.evidence", "run_evidence", "controls and ablations of the distillation claim"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    stages = "\n".join(f"  {name:<10} {stage.help}" for name, stage in STAGES.items())
    parser = argparse.ArgumentParser(
        prog="redumix", description=__doc__, epilog=f"stages:\n{stages}", formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("stage", choices=STAGES, metavar="STAGE", help="one of the stages listed below")
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
    signal.signal(signal.SIGTERM, _interrupt)  # a scheduler's stop ends the stage as Ctrl-C does
    try:
        if rank() == 0:
            run.root.mkdir(parents=True, exist_ok=True)
        with run_folder_lock(run.root, stage):
            if rank() == 0:
                atomic_write_text(run.config, config_to_yaml(config))
            print0(f"redumix {stage}: run folder {run.root}, recipe {config.name}")
            run_stage(stage, config, run)
    except RunFolderBusy as exc:
        if rank() == 0:
            print(f"redumix {stage}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print0(f"\nredumix {stage}: interrupted. Every file already written in {run.root} is kept whole; run the same "
               "command again to resume where it stopped", file=sys.stderr)
        return 130
    except PermissionError as exc:
        print(f"redumix {stage}: error: {permission_message(exc, run)}", file=sys.stderr)
        return 1
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"redumix {stage}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"redumix {stage}: error: {disk_full_message(exc, run)}", file=sys.stderr)
        return 1
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def disk_full_message(exc: OSError, run: RunDir) -> str:
    """A write that found no space, with the path it could not write (a temporary file stands for its target)."""
    path = Path(exc.filename) if exc.filename else None
    if path is not None and path.name.startswith(".") and path.name.endswith(".tmp"):
        path = path.parent
    where = path or run.root
    return (f"{where}: no space left on the device; free some space (or pass another --run-dir), then run the same "
            "command again: the files already written are whole and the stage resumes")


def permission_message(exc: PermissionError, run: RunDir) -> str:
    """A refused read or write, with the path and what to do (a temporary file stands for its folder)."""
    path = Path(exc.filename) if exc.filename else run.root
    if path.name.startswith(".") and path.name.endswith(".tmp"):
        path = path.parent
    return (f"{path}: {exc.strerror or 'permission denied'}; give this user access to it (the run folder "
            f"{run.root} must be writable), or pass another --run-dir")


def run_stage(stage: str, config: Config, run: RunDir) -> None:
    entry = STAGES[stage]
    getattr(importlib.import_module(entry.module), entry.function)(config, run)


if __name__ == "__main__":
    sys.exit(main())
