"""`redumix evidence`: is the mixture a better target than the alternatives, and where does the gain come from?

Every arm trains the same number of steps, on the same harvested problems, from the same base, then is measured the
same way. The arms are the table in pipeline/evidence_arms.py: the mixture arm (the stored p_mix at the recipe's λ,
verifier feedback: the product's own target), p_mix at λ=0, SFT on the redo, on gold and on the model's own attempts
(controls), p_mix from harvests with other feedback, on-policy training, and TRL's SDFT (the student's samples, a
teacher shown x2). `evidence.main_arms` train with every seed of `evidence.seeds`, `evidence.other_arms` with the
first.

Measured per arm: greedy accuracy on `evidence.n` test problems; greedy accuracy on a task variant no arm trains on
(numbers up to `evidence.variant_number_max`, larger than the recipe's); greedy accuracy on the other tasks of
`evidence.forgetting` (forgetting as accuracy, each against the base on the same problems); KL(tuned ‖ base) per
token on the tuned model's own greedy answers to `evidence.drift_n` test prompts; the held-out KL to the stored p_mix;
seconds per step.
Paired tests compare arms on the same problems: each seed against the same seed of the mixture arm, pooled by a
paired bootstrap over problems.

RUN_DIR/evidence/ holds one folder per harvest (`harvest-<kind>/`, the recipe's own harvest is RUN_DIR/harvest) and
one run folder per arm and seed (`<arm>/seed-<s>/` with train/, eval/, variant/, forgetting/<task>/, drift.json).
Every stage resumes as it does alone. `evidence.json`, `evidence.md` and `evidence.png` are written after each arm's
accuracy (the table so far, its drift not yet measured) and complete at the end (`"complete": true`).
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Any

from redumix.common.files import atomic_write_json, atomic_write_text, read_json
from redumix.common.ranks import print0
from redumix.generate.decoder import fingerprint
from redumix.pipeline.config import Config, load_config
from redumix.pipeline.decoders import BASELINE, make_decoder
from redumix.pipeline.embedded_stage import ensure_embedded
from redumix.pipeline.eval import run_eval
from redumix.pipeline.evidence_arms import ARMS, HARVESTS
from redumix.pipeline.harvest import run_harvest
from redumix.pipeline.harvest_folder import claim_settings
from redumix.pipeline.lineage import model_id
from redumix.pipeline.records import record_identity, records_path
from redumix.pipeline.resolve import ConfigError, config_to_yaml
from redumix.pipeline.run import EMBEDDED, RunDir, arm_dir, model_path
from redumix.pipeline.studies.drift import drift_measures, greedy_answers, read_general_set
from redumix.pipeline.studies.evidence_report import (
    evidence_markdown,
    forgetting_dir,
    greedy_records,
    plot_evidence,
    recorded_place,
    summarize_evidence,
)
from redumix.pipeline.studies.rft import rft_harvest
from redumix.pipeline.train import run_train, train_settings


def run_evidence(config: Config, run: RunDir) -> dict[str, Any]:
    ensure_embedded(config, run)
    base = model_path(config.model.path, run).resolve()
    ev = config.evidence
    folder = run.evidence
    records = Path(ev.records) if ev.records else None
    plan = [(arm, seed) for arm in ev.main_arms for seed in ev.seeds]
    plan += [(arm, ev.seeds[0]) for arm in ev.other_arms if arm not in ev.main_arms]
    other_tasks = forgetting_tasks(config)  # a wrong entry stops the stage here, before any arm trains
    steps = study_steps(config, folder, records)  # 0 until the first arm-seed trains: then its steps
    base_here = RunDir(folder / "base")
    if recorded_model(config, records, folder, base_here, base, "base", other_tasks):
        restore_base_caches(records, base_here)
    else:
        eval_greedy(config, base_here, base, checkpoint="base", other_tasks=other_tasks)
    save_base_answers(config, base_here, base)
    for measured, (arm, seed) in enumerate(plan, start=1):
        here = arm_dir(folder, arm, seed)
        if recorded_arm(config, records, folder, here, base, arm, seed, steps, other_tasks):
            print0(f"evidence: arm {arm}, seed {seed} read from the records in {records}")
            steps = steps or read_json(recorded_place(records, folder, here) / "train-metrics.json")["steps"]
        else:
            harvest = harvest_for(config, run, ARMS[arm].harvest)
            settings = arm_config(config, base, harvest, arm, seed, steps)
            print0(f"evidence: arm {arm}, seed {seed} in {here.root}")
            here.root.mkdir(parents=True, exist_ok=True)
            atomic_write_text(here.config, config_to_yaml(settings))
            trained = run_train(settings, here)
            steps = steps or trained["steps"]
            eval_greedy(settings, here, here.train / "merged", checkpoint="tuned", other_tasks=other_tasks)
            # Drift right after the arm's accuracy, while its weights are here: run folders may not outlive a
            # sitting, and a study of many arms is measured over days from its committed records.
            measure_drift(settings, here, here.train / "merged", base)
        # The table so far: a plan of many arms runs for days in sittings, and each arm is worth reading the day
        # it is measured.
        summary = write_summary(config, folder, plan, measured, list(other_tasks))
    print0(evidence_markdown(summary))
    return summary


def study_steps(config: Config, folder: Path, records: Path | None) -> int:
    """The steps every arm of the study trains: `train.max_steps` when the recipe sets it; else those of the arm-seeds
    already trained, here or in the records, whichever arm came first; 0 before any has (the first one to train then
    sets them). A plan that runs some arms alone thus trains them as many steps as the study's others."""
    if config.train.max_steps > 0:
        return config.train.max_steps
    trained = {path.parent.parent: read_json(path)["steps"] for path in folder.glob("*/seed-*/train/metrics.json")}
    if records is not None:
        trained |= {path.parent: read_json(path)["steps"] for path in records.glob("*/seed-*/train-metrics.json")}
    if len(set(trained.values())) > 1:
        each = ", ".join(f"{place}: {n}" for place, n in sorted(trained.items(), key=lambda item: str(item[0])))
        raise ConfigError(f"evidence: the arm-seeds already trained for this study trained different steps ({each}), "
                          "and the recipe sets no train.max_steps to choose: delete the folders (and records) of the "
                          "arm-seeds that are not this study's, or set train.max_steps")
    return next(iter(trained.values()), 0)


def write_summary(config: Config, folder: Path, plan: list[tuple[str, int]], measured: int,
                  tasks: list[str]) -> dict[str, Any]:
    """evidence.json, .md and .png over the first `measured` arms of the plan; complete once every arm is."""
    records = Path(config.evidence.records) if config.evidence.records else None
    summary = summarize_evidence(config, folder, plan[:measured], tasks, records)
    summary["complete"] = measured == len(plan)
    summary["planned"] = len(plan)
    atomic_write_json(folder / "evidence.json", summary)
    atomic_write_text(folder / "evidence.md", evidence_markdown(summary))
    plot_evidence(summary, folder / "evidence.png")
    return summary


def harvest_for(config: Config, run: RunDir, kind: str) -> Path:
    """The harvest an arm learns from: the recipe's own in RUN_DIR/harvest, one with one setting changed, or for
    `rft` the recipe's own with `evidence.rft_samples` of the model's samples a problem (pipeline/studies/rft.py)."""
    if kind == "rft":
        own = harvest_for(config, run, "verifier")
        if not config.evidence.rft_samples:
            return own
        return rft_harvest(config, model_path(config.model.path, run).resolve(), own,
                           run.evidence / "harvest-rft")
    if kind == "verifier":
        run_harvest(config, run)
        return run.harvest
    here = RunDir(run.evidence / f"harvest-{kind}")
    settings = dataclasses.replace(config, model=dataclasses.replace(config.model, path=str(run.embedded.resolve()))
                                   if config.model.path == EMBEDDED else config.model,
                                   redumix=dataclasses.replace(config.redumix, **HARVESTS[kind]))
    here.root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(here.config, config_to_yaml(settings))
    run_harvest(settings, here)
    return here.harvest


def arm_config(config: Config, base: Path, harvest: Path, arm: str, seed: int, steps: int) -> Config:
    # The arms compare targets on the harvest's rows alone: the round policy's extra rows (skill rows, replay) are
    # what `redumix ablation` measures, and they would blur a comparison of targets.
    train = dataclasses.replace(config.train, harvest_dir=str(harvest), seed=seed, skill_rows=False, replay=0.0,
                                **ARMS[arm].train)
    if steps:
        train = dataclasses.replace(train, max_steps=steps)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, path=str(base)), train=train)


# --- measuring one model ----------------------------------------------------------------------------------------


def forgetting_tasks(config: Config) -> dict[str, Config]:
    """`evidence.forgetting`'s recipes, loaded, by their task's name (the name of their column and folder)."""
    tasks: dict[str, Config] = {}
    for i, entry in enumerate(config.evidence.forgetting):
        recipe, *overrides = shlex.split(entry)
        try:
            other = load_config(recipe, overrides)
        except ConfigError as e:
            raise ConfigError(f"evidence.forgetting[{i}] ({entry!r}): {e}") from None
        if other.task.name in tasks:
            raise ConfigError(f"evidence.forgetting[{i}] ({entry!r}) measures task {other.task.name!r} a second "
                              "time: list each task once")
        tasks[other.task.name] = other
    return tasks


def greedy_evals(config: Config, here: RunDir, model: Path,
                 other_tasks: dict[str, Config] | None = None) -> list[tuple[Config, RunDir]]:
    """The greedy evals that measure one model, each with the folder it writes: the test split, (on arith) the
    held-out variant, and each of `other_tasks`. Past the test split the model measured is the eval's "base"
    checkpoint (model.path)."""
    ev = config.evidence
    greedy_only = dataclasses.replace(config.eval, decoders=[BASELINE], tuned_decoders=[], n=ev.n, n_other=ev.n)
    measured = dataclasses.replace(config.model, path=str(model))
    evals = [(dataclasses.replace(config, model=measured, eval=greedy_only), here)]
    if config.task.name == "arith":
        arith = dataclasses.replace(config.task.arith, start_max=ev.variant_number_max,
                                    operand_max=ev.variant_number_max)
        variant = dataclasses.replace(config, model=measured, task=dataclasses.replace(config.task, arith=arith),
                                      eval=dataclasses.replace(greedy_only, checkpoints=["base"]))
        evals.append((variant, RunDir(here.root / "variant")))
    for name, other in (other_tasks or {}).items():
        # The other recipe decides the problems, prompts and answer length; this one the engine and the batch.
        on_other = dataclasses.replace(
            config, model=measured, task=other.task, sampling=other.sampling,
            eval=dataclasses.replace(greedy_only, checkpoints=["base"], n=other.eval.n, n_other=other.eval.n,
                                     split=other.eval.split))
        evals.append((on_other, forgetting_dir(here, name)))
    return evals


def eval_greedy(config: Config, here: RunDir, model: Path, checkpoint: str,
                other_tasks: dict[str, Config] | None = None) -> None:
    """Every greedy eval of `greedy_evals`, the first as `checkpoint`."""
    for i, (settings, folder) in enumerate(greedy_evals(config, here, model, other_tasks)):
        if i == 0:
            settings = dataclasses.replace(settings, eval=dataclasses.replace(settings.eval, checkpoints=[checkpoint]))
        run_eval(settings, folder)


def save_base_answers(config: Config, here: RunDir, base: Path) -> None:
    """The base's greedy answers to the general set's questions, which every arm's off-task KL reads: decoded once,
    also when the base's grades come from records that lack them."""
    ev = config.evidence
    if ev.general_path:
        general = read_general_set(Path(ev.general_path), ev.drift_n)
        if saved_answers(here, general.questions) is None:
            answers = greedy_answers(config, base, general.questions)
            here.root.mkdir(parents=True, exist_ok=True)
            atomic_write_json(here.root / "general_answers.json", {"questions": general.questions,
                                                                    "answer_ids": answers})


# --- reading back a committed record (`evidence.records`) -----------------------------------------------------------


def recorded_model(config: Config, records: Path | None, folder: Path, here: RunDir, model: Path, checkpoint: str,
                   other_tasks: dict[str, Config]) -> bool:
    """Whether `records` holds every greedy eval of this model in full, made by the same decoder and engine (and, for
    the base, the same weights); a partial or other record is said and measured again."""
    if records is None or not recorded_place(records, folder, here).is_dir():
        return False
    weights = model_id(model) if checkpoint == "base" else None  # a tuned model's weights are gone with its folder
    for i, (settings, rd) in enumerate(greedy_evals(config, here, model, other_tasks)):
        name = checkpoint if i == 0 else "base"
        place = recorded_place(records, folder, rd)
        index = read_json(place / "index.json") if (place / "index.json").is_file() else {}
        entry = index.get(records_path(place, name, BASELINE).name)
        decoder = fingerprint(make_decoder(settings, BASELINE, {}))
        wanted = record_identity(weights, decoder, settings.engine)
        if entry is None or entry["n"] != settings.eval.n:
            why = "none" if entry is None else f"{entry['n']} problems, not {settings.eval.n}"
            print0(f"evidence: {place}: {why} of {name}'s greedy recorded; measured again")
            return False
        made_by = [m.split(":", 1)[1] if weights is None else m for m in entry["model"]]
        if made_by != [wanted.split(":", 1)[1] if weights is None else wanted]:
            print0(f"evidence: {place}: recorded by {entry['model']}, not {wanted} (weights:decoder:engine); "
                   "measured again")
            return False
    return True


def recorded_arm(config: Config, records: Path | None, folder: Path, here: RunDir, base: Path, arm: str, seed: int,
                 steps: int, other_tasks: dict[str, Config]) -> bool:
    """Whether `records` holds this arm-seed: its greedy evals and its train summary and settings (the same as this
    arm would train with, from the same base). Its drift is read when recorded; an arm-seed recorded without it
    (before drift came with each arm) is read back with its drift not measured, the table says so."""
    if not recorded_model(config, records, folder, here, Path("tuned"), "tuned", other_tasks):
        return False
    assert records is not None
    place = recorded_place(records, folder, here)
    missing = [name for name in ("train-metrics.json", "train-settings.json") if not (place / name).is_file()]
    if missing:
        print0(f"evidence: {place}: no {', '.join(missing)}; measured again")
        return False
    trained = read_json(place / "train-metrics.json")
    inputs = trained["inputs"]
    if inputs["base"] != model_id(base):
        print0(f"evidence: {place}: trained from base {inputs['base']}, not {model_id(base)}; measured again")
        return False
    # The harvest is the one thing that may differ: a run folder lost with its harvest leaves the arms measured on
    # it, and a new harvest of the same recipe asks the same problems. The table names each arm-seed's harvest.
    # The study's first arm-seed may have trained by epochs (train.max_steps -1) and so set the steps every other one
    # trains (`study_steps`): having trained those steps, it is held to the settings it trained with.
    by_epochs = trained["steps"] == steps and _recorded_max_steps(place / "train-settings.json") == -1
    settings = arm_config(config, base, Path(), arm, seed, 0 if by_epochs else steps)
    try:
        claim_settings(place / "train-settings.json", train_settings(settings), "records",
                       "measured again")
    except ValueError as e:
        print0(f"evidence: {e}")
        return False
    return True


def _recorded_max_steps(path: Path) -> Any:
    """train.max_steps in a train-settings file, of either layout (claim_settings: a record, or a version 0 config)."""
    stored = read_json(path)
    return stored.get("record", stored).get("train", {}).get("max_steps")


def restore_base_caches(records: Path | None, here: RunDir) -> None:
    """The base's answers to the general questions and its loss on their texts, read by every arm's drift."""
    assert records is not None
    for name in ("general_answers.json", "text_nll.json"):
        source = recorded_place(records, here.root.parent, here) / name
        if source.is_file() and not (here.root / name).is_file():
            here.root.mkdir(parents=True, exist_ok=True)
            atomic_write_text(here.root / name, source.read_text())


def measure_drift(config: Config, here: RunDir, model: Path, base: Path) -> None:
    """A tuned model's drift from the base (pipeline/studies/drift.py), once: drift.json is read back on a resumed
    run."""
    ev = config.evidence
    general = read_general_set(Path(ev.general_path), ev.drift_n) if ev.general_path else None
    drift = read_json(here.root / "drift.json") if (here.root / "drift.json").is_file() else {}
    if "kl_tuned_base" in drift and (general is None or "kl_offtask" in drift):
        return
    records = greedy_records(here, "tuned")[: ev.drift_n]
    base_folder = here.root.parents[1] / "base"
    answers = None if general is None else saved_answers(RunDir(base_folder), general.questions)
    base_nll = None if general is None else saved_text_nll(base_folder, general.texts)
    drift = drift_measures(config, model, base, records, general, answers, base_nll)
    atomic_write_json(here.root / "drift.json", drift)
    if general is not None and base_nll is None:
        atomic_write_json(base_folder / "text_nll.json", {"texts": general.texts,
                                                           "text_nll": drift["text_nll_base"]})


def saved_answers(here: RunDir, questions: list[str]) -> list[list[int]] | None:
    """The base's saved greedy answers to `questions`, or None when they were saved for other questions (a longer
    list serves a shorter one: each answer depends on its own question only)."""
    path = here.root / "general_answers.json"
    if not path.is_file():
        return None
    saved = read_json(path)
    if saved["questions"][: len(questions)] != questions:
        return None
    return saved["answer_ids"][: len(questions)]


def saved_text_nll(base_folder: Path, texts: list[str]) -> float | None:
    """The base's loss on exactly these general texts, where an earlier arm measured it."""
    path = base_folder / "text_nll.json"
    if not path.is_file() or (saved := read_json(path))["texts"] != texts:
        return None
    return float(saved["text_nll"])
