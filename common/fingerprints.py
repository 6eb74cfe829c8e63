"""Fingerprints: the hash of a canonical record of what changes a stage's outputs, and the one migration of the
markers written before records had a version (docs/robustness.md, "Fingerprints and old run folders").

A record is a plain dict that names what it holds in its own words: `redumix.lam`, `task.settings.steps_max`,
`embedded.model.hidden_size`. The code that knows the outputs builds it key by key (`harvest_record` in
pipeline/harvest_folder.py, `build_record` in embedded/build.py, `task_record` in data/tasks.py), leaving out what
changes only speed or float rounding. So a rename or a move in the config changes the line that reads the setting,
never the record, and no fingerprint needs a shim. A marker keeps its record beside its fingerprint, so a refusal
names the keys that differ.

`RECORD_VERSION` is the records' form. Adding a setting that changes outputs to a record is a new version and one
more step in this module that gives the new key the value that reproduces the older outputs. A task's setting whose
default reproduces them is instead left out of the record at that default (`task_record`:
`task.constraints.holdout_requests`), so it keeps the version and every older fingerprint.

Version 0 is what markers held before: a hash of the config's layout (`harvest/fingerprint.json`: the settings in
the layout of 2026-11, with the embedded section flat under `base`; `embedded/build_config.yaml`: the same
flat `base` and every task's settings in one flat `task`), or the layout itself (the ladder's and the rft samples'
`settings.json`: `asdict` of the config's sections, every task's section under `task`). `harvest_record_v0`,
`build_record_v0`, `ladder_record_v0` and `rft_record_v0` read them into version 1; the stages call them when they
meet an old marker and then rewrite it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from redumix.common.files import json_text

RECORD_VERSION = 1


def fingerprint(record: dict[str, Any]) -> str:
    """16 hex digits of the SHA-256 of the versioned record as canonical JSON (sorted keys)."""
    text = json_text({"version": RECORD_VERSION, "record": record}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --- version 0 ------------------------------------------------------------------------------------------------------
# The keys of the flat layouts, as they were when version 0 was retired (never edited: they describe old files).

_ARITH_V0 = ("steps_min", "steps_max", "start_max", "operand_max", "factor_max", "mul_value_max")
_MODEL_V0 = ("steps", "batch_rows", "seq_len", "vocab_size", "hidden_size", "layers", "heads", "intermediate_size",
             "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "bf16")
_CORPUS_V0 = ("mix_solution", "mix_reflection", "mix_critique", "mix_refine", "mix_longhand", "slip_rate",
              "wrong_attempt_rate", "noisy_feedback_rate", "check_span_rate")
_MEASURE_V0 = ("eval_n", "eval_reflection")
_SAMPLING_V0 = ("temperature", "top_p", "top_k", "max_new_tokens")


def v0_hash(settings: dict[str, Any]) -> str:
    """The version 0 fingerprint of a harvest's settings, as `harvest/fingerprint.json` held it."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def task_record_v0(flat: dict[str, Any]) -> dict[str, Any]:
    """The task record (data/tasks.py `task_record`) of version 0's flat task: name, gsm8k's path, prompt_suffix and
    arith's fields, with a later task's own section under its name."""
    name = flat["name"]
    if name == "arith":
        settings = {key: flat[key] for key in _ARITH_V0}
    elif name == "gsm8k":
        settings = {"path": flat["path"]}
    else:
        settings = flat.get(name)
    return {"name": name, "prompt_suffix": flat["prompt_suffix"], "settings": settings}


def build_record_v0(stored: dict[str, Any]) -> dict[str, Any]:
    """The build record (embedded/build.py `build_record`) of a version 0 `build_config.yaml` ({seed, base, task}),
    or of a harvest's version 0 `base` section with the seed and task beside it."""
    base = stored["base"]
    return {"seed": stored["seed"],
            "model": {key: base[key] for key in _MODEL_V0},
            "corpus": {key: base[key] for key in _CORPUS_V0},
            "measure": {key: base[key] for key in _MEASURE_V0},
            "task": task_record_v0(stored["task"])}


def harvest_record_v0(settings: dict[str, Any]) -> dict[str, Any]:
    """The harvest record (pipeline/harvest_folder.py `harvest_record`) of a version 0 `fingerprint.json`'s settings.
    A key added after version 0 began is absent where it was at the value that kept the old rows."""
    model, redumix, harvest = settings["model"], settings["redumix"], settings["harvest"]
    embedded = model["path"] == "base"  # the embedded model's name before it was `embedded`
    return {
        "seed": settings["seed"],
        "task": {**task_record_v0(settings["task"]), "name": settings["task_name"]},
        "model": {"path": "embedded" if embedded else model["path"], "dtype": model["dtype"]},
        "embedded": build_record_v0({"seed": settings["seed"], "base": settings["base"], "task": settings["task"]})
        if embedded else None,
        "sampling": {key: settings["sampling"][key] for key in _SAMPLING_V0},
        "redumix": {
            **{key: redumix[key] for key in ("lam", "topk", "feedback", "reflection_max_tokens",
                                             "critique_max_tokens")},
            "feedback_file": redumix["feedback_file"] if redumix["feedback"] == "human" else None,
            "instruction": redumix.get("instruction", "redo"),
            "redo_temperature": redumix.get("redo_temperature"),
        },
        "harvest": {"n": harvest["n"], "split": harvest["split"], "skip": harvest.get("skip", 0),
                    "shard_rows": harvest["shard_rows"]},
    }


def _task_record_asdict_v0(task: dict[str, Any]) -> dict[str, Any]:
    """The task record of version 0's `asdict(config.task)`: name, prompt_suffix and a section per task (as many as
    there were tasks then), of which the named task's is its settings."""
    return {"name": task["name"], "prompt_suffix": task["prompt_suffix"], "settings": task.get(task["name"])}


def ladder_record_v0(settings: dict[str, Any]) -> dict[str, Any]:
    """The ladder record (pipeline/studies/ladder.py `ladder_record`) of a version 0 `ladder/settings.json`:
    `asdict` of model, task, sampling and redumix (less the redo's keys), and the ladder's levers, which held the
    redo's effective temperature and instruction. The engine was `ladder.engine` before it was the top-level
    `engine`, and before either the ladder ran on redumix's own loop alone."""
    ladder, redumix = settings["ladder"], settings["redumix"]
    self_critique = ladder["self_critique"]
    return {
        "seed": settings["seed"],
        "task": _task_record_asdict_v0(settings["task"]),
        "model": {"path": settings["model"]["path"], "dtype": settings["model"]["dtype"]},
        "sampling": {key: settings["sampling"][key] for key in _SAMPLING_V0},
        "redumix": {"reflection_max_tokens": redumix["reflection_max_tokens"], "instruction": ladder["instruction"],
                    "redo_temperature": ladder["redo_temperature"],
                    "lam": redumix["lam"] if self_critique else None,
                    "critique_max_tokens": redumix["critique_max_tokens"] if self_critique else None},
        "ladder": {"lams": ladder["lams"], "self_critique": self_critique},
        "engine": settings.get("engine", ladder.get("engine", "hf")),
    }


def rft_record_v0(settings: dict[str, Any]) -> dict[str, Any]:
    """The rft samples' record (pipeline/studies/rft.py `rft_record`) of a version 0 `settings.json`: the seed,
    `asdict` of model and task, and the samples' policy."""
    return {"seed": settings["seed"], "task": _task_record_asdict_v0(settings["task"]),
            "model": {"path": settings["model"]["path"], "dtype": settings["model"]["dtype"]},
            "policy": {key: settings["policy"][key] for key in _SAMPLING_V0}}
