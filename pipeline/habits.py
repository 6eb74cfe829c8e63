"""Habits from TRL and transformers' `TrainingArguments`, met at redumix's door.

A user who knows TRL types `--config my.yaml`, `--harvest.n 8`, `--output_dir DIR` or `per_device_train_batch_size=8`.
Each either works (`--config` is `--recipe`; `--KEY VALUE` with a dotted key is the override `KEY=VALUE`) or gets a
one-line hint that names the redumix form, instead of argparse's "unrecognized arguments" or a list of 40 keys.
This module knows names only: the CLI rewrites the command line with `translate`, and the config's unknown-key
error asks `foreign_hint`.
"""

from __future__ import annotations

# TrainingArguments' and TRL's names for what redumix calls otherwise, with the same meaning and values: the name,
# redumix's key. A name that redumix shares (`learning_rate`, `max_steps`) needs no line: written as a key, the
# config's "did you mean" finds its section.
FOREIGN_KEYS = {
    "per_device_train_batch_size": "train.batch_size",
    "per_device_eval_batch_size": "eval.batch_size",
    "num_train_epochs": "train.epochs",
    "gradient_accumulation_steps": "train.grad_accum",
    "model_name_or_path": "model.path",
    "lr_scheduler_type": "train.lr_scheduler",
    "max_seq_length": "train.max_length",
    "lora_r": "train.lora_rank",
    "torch_dtype": "model.dtype",
    "lmbda": "train.on_policy_share",
}
# Flags that name no config key: the flag, what redumix does instead.
FOREIGN_FLAGS = {
    "output_dir": "redumix writes every stage's outputs under one run folder: --run-dir DIR (default runs/<recipe "
                  "name>; train's checkpoints go to DIR/train/)",
}
# The CLI's own options, which pass through untouched.
OWN_FLAGS = {"-h", "--help", "-v", "--verbose", "--recipe", "--config", "--run-dir", "--model"}


class HabitError(ValueError):
    """A TRL habit that redumix spells otherwise; the message is the one line that says how."""


def foreign_hint(key: str) -> str | None:
    """For an unknown config key named like a TrainingArguments field: which redumix key it is."""
    name = key.rpartition(".")[2]
    if name in FOREIGN_KEYS:
        return f"that is TRL's name; redumix's key is {FOREIGN_KEYS[name]!r}"
    return None


def translate(argv: list[str]) -> list[str]:
    """The command line with TRL's forms rewritten where they have one meaning here; raises HabitError with a hint
    where they do not. Anything else (a flag redumix does not know at all) is left for argparse to refuse."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        item = argv[i]
        i += 1
        if not item.startswith("--") or item == "--" or item.split("=", 1)[0] in OWN_FLAGS:
            out.append(item)
            continue
        flag, eq, inline = item[2:].partition("=")
        name = flag.replace("-", "_")
        if "." not in flag and name not in FOREIGN_FLAGS and name not in FOREIGN_KEYS:
            out.append(item)  # not ours to explain: argparse refuses it as unrecognized
            continue
        value = inline if eq else argv[i] if i < len(argv) and not _is_flag(argv[i]) else None
        i += 1 if value is not None and not eq else 0
        if "." in flag:  # `--harvest.n 8`: the override harvest.n=8
            if value is None:
                raise HabitError(f"--{flag} needs a value; redumix takes overrides as {flag}=VALUE")
            out.append(f"{flag}={value}")
        elif name in FOREIGN_FLAGS:
            raise HabitError(f"--{flag} is TRL's flag; {FOREIGN_FLAGS[name]}")
        else:
            key = FOREIGN_KEYS[name]
            raise HabitError(f"--{flag} is TRL's name; redumix's key is {key}: pass {key}={value or 'VALUE'} after "
                             "the recipe, or set it in the recipe")
    return out


def _is_flag(item: str) -> bool:
    """`--x` or `-v` is a flag; `-0.5` is a value."""
    if not item.startswith("-"):
        return False
    try:
        float(item)
    except ValueError:
        return True
    return False
