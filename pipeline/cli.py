"""`redumix STAGE [--recipe R] [--run-dir DIR] [-v] [key.sub=value ...]`, `redumix config`, `redumix decoders`,
`redumix stages`.

The stages are the table in pipeline/stages.py; `redumix --help` lists them and `redumix STAGE --help` lists the
config keys that stage reads (`SECTIONS` below), its own section first. A recipe is a YAML path or a bundled
recipe's name (`--recipe tiny`). TRL's spellings (`--config`, `--harvest.n 8`, `--output_dir`) are rewritten or
answered with a hint by pipeline/habits.py. `config`, `decoders` and `stages` are not stages: they print and touch
no run folder. A stage silences the libraries' own progress bars and warnings; `-v` lets them through.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import signal
import sys
from pathlib import Path

import yaml

from redumix.common.files import atomic_write_json, atomic_write_jsonl, atomic_write_text
from redumix.common.ranks import print0, rank
from redumix.pipeline import reference
from redumix.pipeline.claim import claimed
from redumix.pipeline.config import Config, load_config
from redumix.pipeline.decoders import DECODERS
from redumix.pipeline.habits import translate
from redumix.pipeline.lock import RunFolderBusy
from redumix.pipeline.preflight import check_model_folder, where_set
from redumix.pipeline.records import prompt_grades, read_records
from redumix.pipeline.resolve import EXTENDS, ConfigError, changed_keys, config_to_yaml
from redumix.pipeline.run import RunDir
from redumix.pipeline.stages import STAGES, Stage, stages_text

# The config sections each stage reads besides the top level (`name`, `seed`): what `redumix STAGE --help` lists.
# A stage not named here lists every section. tests/test_cli.py checks each stage module's `config.<section>` reads.
DECODER_SECTIONS = tuple(dict.fromkeys(e.section[0] for e in DECODERS.values() if e.section))
SECTIONS: dict[str, tuple[str, ...]] = {
    "embedded": ("model", "embedded", "task"),
    "harvest": ("model", "embedded", "task", "sampling", "redumix", "harvest", "vllm"),
    "train": ("model", "embedded", "task", "redumix", "harvest", "train"),
    "eval": ("model", "embedded", "task", "sampling", *DECODER_SECTIONS, "eval", "vllm"),
    "export": (),
    "calibrate": ("model", "embedded", "task", "sampling", "reflective", "eval"),
    "ladder": ("model", "embedded", "task", "sampling", "redumix", "ladder", "vllm"),
}
DEFAULT_RECIPE = "tiny"


def stage_sections(stage: str) -> list[str]:
    return list(SECTIONS.get(stage, [s.dotted for s in reference.sections() if s.dotted and "." not in s.dotted]))


def _run_options(parser: argparse.ArgumentParser, recipe_default: str | None = DEFAULT_RECIPE) -> None:
    parser.add_argument("--recipe", default=recipe_default,
                        help="YAML recipe: a path, or a bundled recipe's name such as `tiny` (default: tiny); "
                        "TRL's --config works too")
    parser.add_argument("--config", dest="recipe", default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # TRL's name
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, applied after the recipe (optional)")


ABOUT = """\
redumix: a model answers a task, gets feedback, reflects and redoes it; the redo is decoded from p_mix, a mixture of
the model on the plain prompt and on the prompt with the reflection. redumix harvests those redos, distils them into
the model that sees only the plain prompt, and measures every decoder.

  redumix STAGE [--recipe R] [--run-dir DIR] [-v] [key.sub=value ...]

R is a YAML recipe or a bundled recipe's name (default: tiny). Any key.sub=value after it changes that key; none is
needed. A stage writes into runs/<recipe name>/, beside the resolved config (config.yaml)."""


def _top_parser() -> argparse.ArgumentParser:
    stages = "\n".join(f"  {name:<10} {stage.help}" for name, stage in STAGES.items())
    return argparse.ArgumentParser(
        prog="redumix", description=ABOUT, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"stages (the pipeline: harvest, train, eval):\n{stages}\n\nother commands:\n"
        f"  {'config':<10} print the resolved config; with --name NAME, a recipe of your own\n"
        f"  {'decoders':<10} list the decoders that eval.decoders may name\n"
        f"  {'stages':<10} list the stages\n"
        f"  {'grades':<10} an eval's per-prompt grades, small enough to commit\n\n"
        "`redumix STAGE --help` lists the config keys a stage reads, with defaults and help.",
    )


def _stage_parser(stage: str) -> argparse.ArgumentParser:
    """`redumix STAGE --help`: the stage's own section first, the others it reads, the top level, `embedded` last."""
    names = sorted([*stage_sections(stage), ""], key=lambda s: (s != stage, s == "embedded", s == ""))
    brief = {} if stage == "embedded" else {"embedded": "the embedded default model's build, read when model.path="
                                            "embedded; `redumix embedded --help` lists them"}
    return argparse.ArgumentParser(
        prog=f"redumix {stage}", description=f"redumix {stage}: {STAGES[stage].help}.",
        epilog="config keys it reads (set in the recipe, or key.sub=value here):\n"
        + reference.stage_text(names, brief),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = translate(sys.argv[1:] if argv is None else list(argv))  # TRL's spellings: rewritten, or a hint
    staged = bool(argv) and argv[0] in STAGES  # `redumix STAGE ...`: its own parser, whose --help lists its keys
    parser = _stage_parser(argv[0]) if staged else _top_parser()
    if not staged:
        parser.add_argument("stage", nargs="?", choices=STAGES, metavar="STAGE", help="one of the stages below")
    parser.add_argument("--run-dir", default=None, help="run folder (default: runs/<recipe name>)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="let the libraries speak: model-loading and dataset progress bars, their warnings")
    if argv and argv[0] == "eval":
        parser.add_argument("--model", default=None, metavar="DIR",
                            help="evaluate this Hugging Face folder as it is, under its folder's name, with no "
                            "harvest or train: model.path=DIR eval.checkpoints=[base] eval.base_label=NAME "
                            "(default run folder: runs/NAME)")
    _run_options(parser)
    if not argv:  # a bare `redumix`: what it does and how to run it
        parser.print_help()
        parser.exit()
    args = parser.parse_intermixed_args(argv[1:] if staged else argv)
    if not staged and args.stage is None:
        parser.error(f"name a stage, one of: {', '.join(STAGES)} (`redumix --help` says what each does)")
    args.stage = argv[0] if staged else args.stage  # overrides may follow --recipe, as the Makefile passes
    return args


def resolve(argv: list[str] | None = None) -> tuple[str, Config, RunDir]:
    args = parse_args(argv)
    if not args.verbose:
        quiet_libraries()
    overrides, default_dir = args.overrides, None
    if getattr(args, "model", None):  # `redumix eval --model DIR`: three overrides, which the user's may still change
        name = Path(args.model).resolve().name
        # Quoted (JSON is YAML) so that a folder called `1.5` or `[x]` stays a string.
        overrides = [f"model.path={json.dumps(args.model)}", "eval.checkpoints=[base]",
                     f"eval.base_label={json.dumps(name)}", *overrides]
        default_dir = Path("runs") / name  # not the recipe's run folder, whose eval report it would replace
    config = load_config(args.recipe, overrides)
    if reads_model_path(args.stage, config):  # before any folder is touched, naming where model.path was set
        check_model_folder(config.model.path, "--model" if getattr(args, "model", None) else
                           where_set(args.recipe, args.overrides, "model.path"))
    run = RunDir(Path(args.run_dir) if args.run_dir else default_dir or Path("runs") / config.name)
    return args.stage, config, run


def reads_model_path(stage: str, config: Config) -> bool:
    """Whether the stage loads the model that model.path names (eval only for its `base` checkpoint)."""
    if stage == "eval":
        return "base" in config.eval.checkpoints
    return stage != "embedded" and "model" in stage_sections(stage)


# --- quiet libraries -----------------------------------------------------------------------------------------------

# What a stage prints by default is its own: its tqdm bars, the Trainer's step bar and loss, its summaries. The
# libraries' chatter (transformers' "Loading weights" and "Writing model shards" bars, datasets' Map / Filter bars,
# deprecation and advisory warnings, DeepSpeed's accelerator notice) hides that, so it is off unless `-v`.
LIBRARY_LOGGERS = ("transformers", "datasets", "trl", "peft", "accelerate", "torch", "DeepSpeed")
LIBRARY_MODULES = r"(transformers|datasets|trl|peft|accelerate|deepspeed|torch)(\.|$)"
QUIET_ENVIRONMENT = {"HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                     "DATASETS_VERBOSITY": "error", "TRANSFORMERS_VERBOSITY": "error", "TRL_EXPERIMENTAL_SILENCE": "1"}


def quiet_libraries() -> None:
    """Errors still show. Environment variables reach the libraries not imported yet and torchrun's ranks."""
    import logging
    import os
    import warnings

    from transformers.utils import logging as hf_logging

    for name, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    hf_logging.set_verbosity_error()  # transformers is imported already (the config's decoders import it)
    hf_logging.disable_progress_bar()
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.ERROR)
        # DeepSpeed sets its logger's level itself when it is imported; a filter outlasts that.
        logger.addFilter(lambda record: record.levelno >= logging.ERROR)
    warnings.filterwarnings("ignore", module=LIBRARY_MODULES)


# --- the commands that are not stages: they print, and touch no run folder ----------------------------------------


def config_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="redumix config",
        description="Print the resolved config as YAML: defaults <- recipe <- overrides. With --name, print a recipe "
        "of your own instead: `extends:` the recipe, your name, and only the keys your overrides change.")
    _run_options(parser, recipe_default=None)
    parser.add_argument("--name", help="write a recipe named NAME (its runs go to runs/NAME/) that extends --recipe "
                        "and holds only what the overrides change")
    parser.add_argument("--markdown", action="store_true",
                        help="print the configuration reference (every key's type, default and help) as Markdown "
                        "instead: docs/config.md")
    args = parser.parse_intermixed_args(translate(argv))
    if args.markdown:
        if args.recipe or args.overrides or args.name:
            parser.error("--markdown prints the reference of the defaults; it takes no --recipe, --name or overrides")
        print(reference.markdown(), end="")
        return 0
    recipe = args.recipe or DEFAULT_RECIPE
    if args.name is None:
        print(config_to_yaml(load_config(recipe, args.overrides)), end="")
        return 0
    start = load_config(recipe)
    mine = load_config(recipe, [*args.overrides, f"name={args.name}"])
    print(own_recipe(recipe, mine, start), end="")
    return 0


def own_recipe(recipe: str, mine: Config, start: Config) -> str:
    """A recipe that extends `recipe` with what `mine` changes from `start` (its resolved config), its name first."""
    changed = changed_keys(mine, start)
    changed.pop("name", None)
    head = (f"# {mine.name}: the recipe {recipe} with what differs below; `redumix config --recipe {mine.name}.yaml`"
            " prints it resolved.\n")
    return head + yaml.safe_dump({EXTENDS: recipe, "name": mine.name, **changed}, sort_keys=False)


def decoders_command(argv: list[str]) -> int:
    argparse.ArgumentParser(
        prog="redumix decoders", description="List the decoders that eval.decoders may name (pipeline/decoders.py)."
    ).parse_args(argv)
    for name, entry in DECODERS.items():
        section = f" (settings: {entry.section[0]}.*)" if entry.section else ""
        print(f"{name + entry.suffix:<22} {entry.help}{section}")
    return 0


def stages_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="redumix stages", description="List the stages (pipeline/stages.py).")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--names", action="store_true", help="only the names, on one line (what the Makefile reads)")
    which.add_argument("--ranked", action="store_true", help="only the stages that run on NPROC ranks")
    args = parser.parse_args(argv)
    print(stages_text("--names" if args.names else "--ranked" if args.ranked else ""))
    return 0


# Besides the grades, what an evidence folder keeps of each model, so that `evidence.records` reads an arm-seed back
# after its run folder is gone: its train summary and settings, its drift, and the base's answers and text loss that
# every later arm's drift reads. Small JSON files; never weights. {file in the run folder: its name in OUT}
KEPT_WITH_GRADES = {"train/metrics.json": "train-metrics.json", "train/settings.json": "train-settings.json",
                    "drift.json": "drift.json", "general_answers.json": "general_answers.json",
                    "text_nll.json": "text_nll.json"}


def grades_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="redumix grades", description="Write an eval's per-prompt grades (id, pass, reply tokens, reply hash; "
        "no reply, no weights) to OUT: one JSON Lines file per checkpoint and decoder, and index.json with each "
        "file's model, n and accuracy, so a table can be recomputed after the run folder is gone. Given a folder of "
        "evals instead (RUN_DIR/evidence: each arm's test, variant and forgetting evals), the grades of every eval "
        "under it, each in OUT at its place in the tree, with each model's train summary and settings and its drift "
        "(what `evidence.records` reads back).")
    parser.add_argument("eval_dir", type=Path, help="an eval folder (RUN_DIR/eval) with generations/*.jsonl, or a "
                        "folder with such eval folders under it")
    parser.add_argument("out", type=Path, help="where to write them, e.g. docs/records/NAME")
    args = parser.parse_args(argv)
    if (args.eval_dir / "generations").is_dir():
        found = {Path("."): args.eval_dir}
    else:  # each eval folder's run folder, relative to eval_dir, names its place in OUT
        found = {g.parent.parent.relative_to(args.eval_dir): g.parent
                 for g in sorted(args.eval_dir.glob("**/eval/generations")) if any(g.glob("*.jsonl"))}
    if not found:
        raise FileNotFoundError(f"{args.eval_dir / 'generations'}: no records; run `redumix eval` first")
    files = 0
    for place, eval_dir in found.items():
        index = {}
        for source in sorted((eval_dir / "generations").glob("*.jsonl")):
            records = read_records(source)
            atomic_write_jsonl(args.out / place / source.name, prompt_grades(records))
            index[source.name] = {"model": sorted({r["model"] for r in records}), "n": len(records),
                                  "accuracy": sum(r["correct"] for r in records) / max(len(records), 1)}
        atomic_write_json(args.out / place / "index.json", index)
        files += len(index)
    # Also where no eval is: a base read back from records keeps the answers a later sitting decoded for it.
    for kept, name in KEPT_WITH_GRADES.items():
        for source in sorted(args.eval_dir.glob(f"**/{kept}")):
            place = source.relative_to(args.eval_dir).parts[: -len(Path(kept).parts)]
            atomic_write_text(args.out.joinpath(*place, name), source.read_text())
    print(f"grades: {files} files of {len(found)} evals written to {args.out}")
    return 0


COMMANDS = {"config": config_command, "decoders": decoders_command, "stages": stages_command,
            "grades": grades_command}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv and argv[0] in COMMANDS:
            return COMMANDS[argv[0]](argv[1:])
        stage, config, run = resolve(argv)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"redumix: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)  # a scheduler's stop ends the stage as Ctrl-C does
    try:
        with claimed(run, stage, config_to_yaml(config)):  # a stage that writes nothing leaves the folder as it was
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
    entry: Stage = STAGES[stage]
    getattr(importlib.import_module(entry.module), entry.function)(config, run)


if __name__ == "__main__":
    sys.exit(main())
