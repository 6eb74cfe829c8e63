"""Config: the recipe's sections, composed. `load_config` resolves a recipe into `Config` (pipeline/resolve.py).

Every section is a dataclass that lives next to the code it configures (the sampling policy in
`generate/policy.py`, each decoder's settings in its module, the task's in `data/tasks.py`, ...); `Config` names
them all, so a type checker and an IDE see `config.redumix.lam`. A decoder with settings is its module, its line in
the decoder table (pipeline/decoders.py) and its field here; an evidence arm is one line in
pipeline/evidence_arms.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from redumix.data.tasks import TaskConfig
from redumix.embedded import EmbeddedConfig
from redumix.generate.cntp import CntpConfig
from redumix.generate.model_io import ModelConfig
from redumix.generate.moi import MoiConfig
from redumix.generate.pdr import PdrConfig
from redumix.generate.policy import SamplingPolicy
from redumix.generate.redumix import RedumixConfig, redo_policy
from redumix.generate.reflective import ReflectiveConfig
from redumix.generate.speculative import SpeculativeConfig
from redumix.generate.vllm_engine import VllmSettings
from redumix.pipeline.decoders import DEFAULT_DECODERS, decoders_help
from redumix.pipeline.evidence_arms import ARMS, arms_help
from redumix.pipeline.resolve import ConfigError, resolve
from redumix.pipeline.run import REPO, in_repo
from redumix.train.config import TrainConfig

RECIPES = REPO / "recipes"
_SAFE_NAME = re.compile(r"(?!\.{1,2}$)[A-Za-z0-9._-]+")


@dataclass
class HarvestConfig:
    n: int = field(default=3000, metadata={"help": "Examples to harvest."})
    split: Literal["train", "test"] = field(default="train", metadata={"help": "Task split to harvest from."})
    batch_size: int = field(default=32, metadata={
        "help": "Rows decoded together. More than shard_rows decodes several shards at once (each written whole, "
                "the group the unit of resume): fewer steps where a step costs about the same for more rows."})
    shard_rows: int = field(default=256, metadata={"help": "Rows per Arrow shard (a shard is the unit of resume)."})
    skip: int = field(
        default=0,
        metadata={"help": "Harvest the split's examples [skip, skip + n); `rounds` moves it on by n each round."},
    )
    attempts: int = field(
        default=1,
        metadata={"help": "Rows per example, each with its own seeds (n·attempts rows): more rows from a small split. "
                  "The first attempt's seeds are a one-attempt harvest's. With `sampling` greedy, an example's "
                  "rows share its attempt, critique and reflection (decoded once a batch) and differ in the redo."},
    )

    def __post_init__(self) -> None:
        problems = [f"{name} must be >= 1" for name in ("n", "batch_size", "shard_rows", "attempts")
                    if getattr(self, name) < 1]
        if self.skip < 0:
            problems.append(f"skip must be >= 0, got {self.skip}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class EvalConfig:
    n: int = field(default=1000, metadata={"help": "Held-out examples for greedy decoding."})
    n_other: int = field(
        default=500,
        metadata={"help": "Held-out examples for every other decoder (costlier), each paired with greedy on them."},
    )
    split: Literal["train", "test"] = field(default="test", metadata={"help": "Task split to evaluate on."})
    batch_size: int = field(default=32, metadata={"help": "Examples decoded together."})
    decoders: list[str] = field(
        default_factory=lambda: list(DEFAULT_DECODERS),
        metadata={"help": "Decoders to run, by name (pipeline/decoders.py's DECODERS), in order: "
                  + decoders_help()},
    )
    tuned_decoders: list[str] = field(
        default_factory=list,
        metadata={"help": "The decoders run on the tuned checkpoint; [] = eval.decoders. A subset keeps `make eval` "
                  "within its time budget."},
    )
    checkpoints: list[Literal["base", "tuned"]] = field(
        default_factory=lambda: ["base", "tuned"],
        metadata={"help": "base = model.path; tuned = RUN_DIR/train/merged (skipped with a note if missing)."},
    )
    base_label: str = field(
        default="base",
        metadata={"help": "The report's name for the model.path checkpoint (`redumix eval --model DIR` sets it to the "
                  "folder's name)."},
    )
    sample_temperature: float = field(default=0.7, metadata={"help": "Temperature of the `sample` decoder."})

    def __post_init__(self) -> None:
        problems = [f"{name} must be >= 1" for name in ("n", "n_other", "batch_size") if getattr(self, name) < 1]
        # It names the records' files (eval/generations/LABEL--DECODER.jsonl) and must not pass for the tuned model.
        if not self.base_label or "/" in self.base_label or self.base_label in (".", "..", "tuned"):
            problems.append(f"base_label must be a file name other than 'tuned', not {self.base_label!r}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class RoundsConfig:
    count: int = field(default=3, metadata={"help": "Rounds of harvest -> train -> eval (`make rounds ROUNDS=N`)."})
    decoders: list[str] = field(
        default_factory=lambda: ["greedy", "redumix-oracle"],
        metadata={"help": "What each round's eval runs (eval.n for greedy, eval.n_other for the others)."},
    )
    accumulate: bool = field(
        default=False,
        metadata={"help": "Round k trains on the rows of rounds 1..k, not on its own alone (accumulating bounds "
                  "model collapse where replacing does not: Gerstgrasser et al. 2024)."},
    )
    restart: Literal["last", "start"] = field(
        default="last",
        metadata={"help": "Which model round k trains: 'last' = round k-1's tuned model, 'start' = the rounds' "
                  "starting model (model.path) every round, as ReST-EM does."},
    )
    harvester: Literal["last", "start"] = field(
        default="last",
        metadata={"help": "Which model harvests round k: 'last' = round k-1's tuned model, 'start' = the starting "
                  "model, frozen, while the trained model moves."},
    )

    ablation_seeds: list[int] = field(
        default_factory=lambda: [0, 1, 2],
        metadata={"help": "`redumix ablation`: the trainer seeds of the policy arm; every other arm trains with the "
                  "first."},
    )

    def __post_init__(self) -> None:
        problems = []
        if self.count < 1:
            problems.append(f"count must be >= 1, got {self.count}")
        if not self.ablation_seeds:
            problems.append("ablation_seeds must list at least one seed")
        if not self.decoders:
            problems.append("decoders must name at least one decoder")
        if problems:
            raise ValueError("; ".join(problems))


LADDER_FEEDBACK = ("verifier", "reference", "none", "random")


@dataclass
class LadderConfig:
    """`redumix ladder` (pipeline/studies/ladder.py): does a redo after feedback beat a second sample, on train
    problems."""

    n: int = field(default=200, metadata={"help": "Train problems measured (a larger n later adds to the records)."})
    skip: int = field(default=0, metadata={"help": "Measure the train split's problems [skip, skip + n)."})
    batch_size: int = field(default=16, metadata={"help": "Problems decoded together."})
    lams: list[float] = field(
        default_factory=lambda: [0.5, 0.0],
        metadata={"help": "λ of the redos after the feedback (λ=1 would be the resample arm)."},
    )
    feedback: str = field(
        default="verifier",
        metadata={"help": "The feedback of the redo arms, named `{feedback}@λ`: `verifier` (the task's checker; on "
                  "code the failing test), `reference` (privileged: on code the checker's feedback and the reference "
                  "solution, train problems only), or the controls `none` and `random` (a coin-flip verdict)."},
    )
    self_critique: bool = field(default=True, metadata={"help": "Also redo after the model's own critique, at "
                                                                  "redumix.lam."})
    resamples: int = field(
        default=1,
        metadata={"help": "Independent second tries from x alone at redumix.redo_temperature (k attempts per "
                  "problem). From 2, the table adds, at equal samples, each redo with a resample (keep the one the "
                  "verifier passes) against two resamples; a larger count later adds samples to the records."},
    )
    records: str | None = field(
        default=None,
        metadata={"help": "A folder of committed ladder grades (docs/records/ladder/NAME: grades.jsonl and "
                  "summary.json, from an earlier sitting whose run folder is gone): the problems it holds with "
                  "every arm are taken from it, not decoded again, and the table covers them with the rest. Its "
                  "settings must be this ladder's. null: none."},
    )

    def __post_init__(self) -> None:
        problems = [f"{name} must be >= 1" for name in ("n", "batch_size") if getattr(self, name) < 1]
        if self.skip < 0:
            problems.append(f"skip must be >= 0, got {self.skip}")
        if not self.lams or not all(0 <= lam <= 1 for lam in self.lams):
            problems.append(f"lams must list λ values in [0, 1], got {self.lams}")
        if self.resamples < 1:
            problems.append(f"resamples must be >= 1, got {self.resamples}")
        if self.feedback not in LADDER_FEEDBACK:
            problems.append(f"feedback must be one of {', '.join(LADDER_FEEDBACK)}, got {self.feedback!r} (the "
                            "self-critique arm is ladder.self_critique)")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class EvidenceConfig:
    seeds: list[int] = field(
        default_factory=lambda: [0, 1, 2],
        metadata={"help": "Trainer seeds (train.seed) of the main arms; the other arms train with the first."},
    )
    main_arms: list[str] = field(
        default_factory=lambda: ["mixture", "lambda0", "redo", "gold", "original"],
        metadata={"help": f"Arms trained with every seed (pipeline/evidence_arms.py): {arms_help()}."},
    )
    other_arms: list[str] = field(
        default_factory=lambda: ["feedback-self", "feedback-none", "feedback-random", "on-policy"],
        metadata={"help": "Arms trained with the first seed only."},
    )
    n: int = field(default=1000, metadata={"help": "Held-out test problems per greedy comparison."})
    variant_number_max: int = field(
        default=30,
        metadata={"help": "The held-out task variant no arm trains on: arith with start values and operands up to "
                  "this (the tiny recipe trains on up to 20); why 30: docs/measurements.md, 'The held-out variant'."},
    )
    drift_n: int = field(default=200, metadata={"help": "Test prompts on which KL(tuned ‖ base) is measured."})
    rft_samples: int = field(
        default=0,
        metadata={"help": "The `rft` arm's samples per problem: the starting model's k independent samples from x "
                  "alone at rft_temperature, of which it learns the right ones with the right attempt "
                  "(pipeline/studies/rft.py). 0: the right attempts alone."},
    )
    rft_temperature: float | None = field(
        default=None,
        metadata={"help": "The temperature of the `rft` arm's samples; null: redumix.redo_temperature's (then they "
                  "are the ladder's resamples)."},
    )
    general_path: str | None = field(
        default=None,
        metadata={"help": "A JSONL file of 'question'/'answer' objects outside the task (GSM8K's test.jsonl, say) for "
                  "two more drift measures on its first drift_n lines: KL(tuned ‖ base) on the base's greedy answers "
                  "to the questions, and the loss of the answers read as plain text. null skips both."},
    )
    forgetting: list[str] = field(
        default_factory=list,
        metadata={"help": "Forgetting as accuracy: other tasks on which the base and every arm are measured greedy, "
                  "each a recipe with overrides as on the command line ('qwen2.5-coder-0.5b-gsm8k eval.n=200'). "
                  "Its task, prompt suffix, sampling and eval.n are used, the model is the arm's; the tasks must "
                  "differ. Each is a column of the table with its paired change against the base."},
    )
    records: str | None = field(
        default=None,
        metadata={"help": "A folder of committed grades (`redumix grades RUN_DIR/evidence docs/records/NAME`): the "
                  "base and every arm-seed it holds (each eval's grades, the train summary and settings, the drift "
                  "where measured) are read from it, not trained or decoded again, so a study outlives its run "
                  "folder. One recorded with other settings, decoder or base is said and measured again. null: none."},
    )

    def __post_init__(self) -> None:
        problems = []
        unknown = [a for a in [*self.main_arms, *self.other_arms] if a not in ARMS]
        if unknown:
            problems.append(f"unknown arms {unknown}; known: {', '.join(ARMS)}")
        if not self.seeds:
            problems.append("seeds must list at least one seed")
        if not self.main_arms and not self.other_arms:
            problems.append("main_arms and other_arms list no arm: name at least one")
        if self.rft_samples < 0:
            problems.append(f"rft_samples must be >= 0, got {self.rft_samples}")
        if self.rft_temperature is not None and self.rft_temperature <= 0:
            problems.append(f"rft_temperature must be > 0 or null, got {self.rft_temperature}")
        if self.n < 1 or self.drift_n < 1 or self.variant_number_max < 2:
            problems.append("n and drift_n must be >= 1, variant_number_max >= 2")
        if any(not entry.strip() for entry in self.forgetting):
            problems.append("forgetting lists an empty entry: each is a recipe, then its overrides")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class Config:
    """The recipe: its sections in order. A decoder with settings reads its own section (its `DECODERS` line names
    the key), so adding one costs its module, its table line and one field here; tests/test_extending.py checks that
    every section a table line names is a field."""

    name: str = field(default="", metadata={"help": "Run name; defaults to the recipe file's stem."})
    seed: int = field(
        default=0,
        metadata={"help": "The run's one seed: which problems, the embedded model's and trainer's initialisation and "
                  "data order, and every example's sampling noise (each example derives its own from it and its id)."},
    )
    engine: Literal["hf", "vllm"] = field(
        default="hf",
        metadata={"help": "What decodes every stage (harvest, eval, ladder, RFT's samples): 'hf', redumix's own loop "
                  "on transformers, or 'vllm', an in-process vLLM engine with each redo as paired requests (`make "
                  "vllm` installs it; settings in the `vllm` section; not the embedded default, whose head_dim "
                  "vLLM's CPU kernel lacks). Both draw with the same per-example noise. Decoders that need the cache "
                  "token by token (reflective, moi, cntp, speculative, pdr) run on 'hf' either way."},
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    embedded: EmbeddedConfig = field(default_factory=EmbeddedConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sampling: SamplingPolicy = field(default_factory=SamplingPolicy)
    # The decoders' sections, in the table's order (pipeline/decoders.py).
    redumix: RedumixConfig = field(default_factory=RedumixConfig)
    moi: MoiConfig = field(default_factory=MoiConfig)
    cntp: CntpConfig = field(default_factory=CntpConfig)
    pdr: PdrConfig = field(default_factory=PdrConfig)
    reflective: ReflectiveConfig = field(default_factory=ReflectiveConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    harvest: HarvestConfig = field(default_factory=HarvestConfig)
    vllm: VllmSettings = field(default_factory=VllmSettings)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rounds: RoundsConfig = field(default_factory=RoundsConfig)
    evidence: EvidenceConfig = field(default_factory=EvidenceConfig)
    ladder: LadderConfig = field(default_factory=LadderConfig)

    def __post_init__(self) -> None:
        # The run folder defaults to runs/<name>: a name with a path in it would write outside runs/.
        if self.name and not _SAFE_NAME.fullmatch(self.name):
            raise ValueError(f"name {self.name!r} must be letters, digits, '.', '_' or '-' (it names the folder "
                             "runs/<name>); use --run-dir to choose another folder")
        if self.ladder.resamples > 1 and redo_policy(self.redumix, self.sampling).greedy:
            raise ValueError(f"ladder.resamples={self.ladder.resamples} needs redumix.redo_temperature > 0: a greedy "
                             "second try is the attempt again")
        if self.harvest.attempts > 1 and self.sampling.temperature == 0 and redo_policy(self.redumix,
                                                                                     self.sampling).greedy:
            raise ValueError(f"harvest.attempts={self.harvest.attempts} would harvest the same greedy row "
                             f"{self.harvest.attempts} times: set sampling.temperature or redumix.redo_temperature "
                             "> 0")
        if self.evidence.rft_samples and self.evidence.rft_temperature is None and redo_policy(
                self.redumix, self.sampling).greedy:
            raise ValueError(f"evidence.rft_samples={self.evidence.rft_samples} samples at the redo's temperature, "
                             "and the redo is greedy here: set evidence.rft_temperature (or redumix.redo_temperature) "
                             "> 0")


def load_config(recipe: str | Path | None, overrides: list[str] = ()) -> Config:
    """Defaults <- recipe YAML <- overrides (pipeline/resolve.py). Raises ConfigError listing every problem."""
    recipe = find_recipe(recipe) if recipe is not None else None
    config = resolve(Config, recipe, overrides, find=find_extended)
    if not config.name:
        config.name = Path(recipe).stem if recipe is not None else "default"
    return config


def find_extended(name: str, folder: Path) -> Path:
    """The recipe that another (in `folder`) `extends`: a path relative to that recipe's folder, else as
    `find_recipe` finds one."""
    beside = folder / name
    return beside if beside.is_file() else find_recipe(name)


def bundled_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES.glob("*.yaml"))


def find_recipe(recipe: str | Path) -> Path:
    """A recipe file: the path as given, else that path inside the repository (the Makefile's `recipes/tiny.yaml`
    from another directory), else a bundled recipe's name (`tiny`, `tiny.yaml`)."""
    given = Path(recipe)
    tries = [given] if given.is_absolute() else [in_repo(given), RECIPES / given, RECIPES / f"{given}.yaml"]
    for path in tries:
        if path.is_file():
            return path
    raise ConfigError(f"recipe not found: {recipe} (pass --recipe PATH to a YAML file, or a bundled recipe's name: "
                      f"{', '.join(bundled_recipes())})")
