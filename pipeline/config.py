"""Config: the recipe's sections, composed. `load_config` resolves a recipe into `Config` (pipeline/resolve.py).

Every section is a dataclass that lives next to the code it configures (the sampling policy in
`generate/policy.py`, each decoder's settings in its module, the task's in `data/tasks.py`, ...). The decoders'
sections come from the decoder table (pipeline/decoders.py) and the evidence arms from theirs
(pipeline/evidence_arms.py): adding a decoder or an arm is one line there, with nothing to repeat here.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from redumix.data.arith import CorpusSpec
from redumix.data.chat import SPECIAL_TOKENS
from redumix.data.tasks import TaskConfig
from redumix.generate.model_io import ModelConfig
from redumix.generate.policy import SamplingPolicy
from redumix.pipeline.decoders import DEFAULT_DECODERS, decoder_sections, decoders_help
from redumix.pipeline.evidence_arms import ARMS, arms_help
from redumix.pipeline.resolve import resolve
from redumix.train.config import TrainConfig

_CORPUS = CorpusSpec()  # the embedded base's corpus defaults live in data/arith.py; BaseConfig repeats none


_SAFE_NAME = re.compile(r"(?!\.{1,2}$)[A-Za-z0-9._-]+")


@dataclass
class BaseConfig:
    steps: int = field(default=3500, metadata={"help": "Optimizer steps of base pre-training (fixed, not timed)."})
    batch_rows: int = field(default=2, metadata={"help": "Packed rows per optimizer step."})
    seq_len: int = field(default=512, metadata={"help": "Tokens per packed row; also the model's window."})
    vocab_size: int = field(
        default=768,
        metadata={"help": "Byte-level BPE vocabulary size, special tokens included. 768 makes the fixed instruction "
                  "strings one to four tokens, so a reflection episode is ~190 tokens instead of ~345 at 432."},
    )
    # Narrow and many steps beats wide and few at this budget: on 2-3-step problems, width 96 for 6000 steps reached
    # 77% and width 128 for 4000 steps 48%, while width 192 for 2400 steps reached 14% (same wall time).
    hidden_size: int = field(default=96, metadata={"help": "Model width."})
    layers: int = field(default=4, metadata={"help": "Transformer blocks."})
    heads: int = field(default=4, metadata={"help": "Attention heads (hidden_size must divide by it)."})
    intermediate_size: int = field(default=256, metadata={"help": "MLP width."})
    lr: float = field(default=3e-3, metadata={"help": "Peak AdamW learning rate."})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "Cosine decays to lr * this."})
    warmup_steps: int = field(default=60, metadata={"help": "Linear warmup steps."})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay on matrices."})
    bf16: bool = field(
        default=False,
        metadata={"help": "bf16 autocast. Off: on this CPU (AVX-512 without BF16) a training step measured 2.8x "
                  "slower in bf16 than in float32."},
    )
    threads: int = field(default=2, metadata={"help": "torch.set_num_threads while building."})
    checkpoint_steps: int = field(
        default=250,
        metadata={"help": "Save weights, optimizer and step every this many steps; a rerun resumes from the last."},
    )
    mix_solution: float = field(
        default=_CORPUS.weights["solution"],
        metadata={"help": "Weight of plain terse solutions in the corpus."}
    )
    mix_reflection: float = field(
        default=_CORPUS.weights["reflection"],
        metadata={"help": "Weight of reflection episodes."}
    )
    mix_critique: float = field(
        default=_CORPUS.weights["critique"],
        metadata={"help": "Weight of self-critique episodes."}
    )
    mix_refine: float = field(
        default=_CORPUS.weights["refine"], metadata={"help": "Weight of PDR and SR refine episodes."}
    )
    mix_longhand: float = field(
        default=_CORPUS.weights["longhand"], metadata={"help": "Weight of long-hand solutions (LONGHAND prompt)."}
    )
    slip_rate: float = field(
        default=_CORPUS.slip_rate,
        metadata={"help": "Share of trained terse solutions with a slip."}
    )
    wrong_attempt_rate: float = field(
        default=_CORPUS.wrong_attempt_rate,
        metadata={"help": "Share of episode attempts with a slip."}
    )
    noisy_feedback_rate: float = field(
        default=_CORPUS.noisy_feedback_rate,
        metadata={"help": "Reflection episodes whose feedback verdict is wrong (the check overrules it)."},
    )
    check_span_rate: float = field(
        default=_CORPUS.check_span_rate,
        metadata={"help": "Share of terse lines with a hidden check span."}
    )
    eval_n: int = field(default=300, metadata={"help": "Held-out test problems for the base's greedy accuracy."})
    eval_reflection: bool = field(
        default=True, metadata={"help": "Also measure attempt -> feedback -> reflection -> x2-only redo on eval_n."}
    )
    eval_batch_size: int = field(default=100, metadata={"help": "Problems decoded together when measuring."})
    shipped: str | None = field(
        default=None,
        metadata={"help": "A folder with a base that `redumix base` built from these settings. When its "
                  "build_config.yaml matches, harvest, eval, calibrate, rounds and evidence copy it into RUN_DIR/base "
                  "instead of building; `redumix base` always builds from the code."},
    )

    def __post_init__(self) -> None:
        problems = []
        for name in ("steps", "batch_rows", "vocab_size", "hidden_size", "layers", "heads", "intermediate_size",
                     "threads", "eval_n", "eval_batch_size", "checkpoint_steps"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 64:
            problems.append(f"seq_len must be >= 64, got {self.seq_len}")
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            problems.append(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (bytes + special tokens)")
        if self.heads >= 1 and self.hidden_size % self.heads:
            problems.append(f"hidden_size {self.hidden_size} must divide by heads {self.heads}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < 0 or self.weight_decay < 0:
            problems.append("need lr > 0, 0 <= min_lr_ratio <= 1, warmup_steps >= 0, weight_decay >= 0")
        for name in ("slip_rate", "wrong_attempt_rate", "noisy_feedback_rate", "check_span_rate"):
            if not 0 <= getattr(self, name) <= 1:
                problems.append(f"{name} must be in [0, 1], got {getattr(self, name)}")
        mix = [self.mix_solution, self.mix_reflection, self.mix_critique, self.mix_refine, self.mix_longhand]
        if min(mix) < 0 or sum(mix) <= 0:
            problems.append(f"mix_* weights must be >= 0 with a positive sum, got {mix}")
        if problems:
            raise ValueError("; ".join(problems))

    def corpus_spec(self) -> CorpusSpec:
        weights = {"solution": self.mix_solution, "reflection": self.mix_reflection, "critique": self.mix_critique,
                   "refine": self.mix_refine, "longhand": self.mix_longhand}
        return CorpusSpec(weights, self.slip_rate, self.wrong_attempt_rate, self.noisy_feedback_rate,
                          self.check_span_rate)


@dataclass
class HarvestConfig:
    n: int = field(default=3000, metadata={"help": "Examples to harvest."})
    split: Literal["train", "test"] = field(default="train", metadata={"help": "Task split to harvest from."})
    batch_size: int = field(default=32, metadata={"help": "Examples decoded together."})
    shard_rows: int = field(default=256, metadata={"help": "Rows per Arrow shard (a shard is the unit of resume)."})
    skip: int = field(
        default=0,
        metadata={"help": "Harvest the split's examples [skip, skip + n); `rounds` moves it on by n each round."},
    )

    def __post_init__(self) -> None:
        problems = [f"{name} must be >= 1" for name in ("n", "batch_size", "shard_rows") if getattr(self, name) < 1]
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
    sample_temperature: float = field(default=0.7, metadata={"help": "Temperature of the `sample` decoder."})

    def __post_init__(self) -> None:
        problems = [f"{name} must be >= 1" for name in ("n", "n_other", "batch_size") if getattr(self, name) < 1]
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class RoundsConfig:
    count: int = field(default=3, metadata={"help": "Rounds of harvest -> train -> eval (`make rounds ROUNDS=N`)."})
    decoders: list[str] = field(
        default_factory=lambda: ["greedy", "redumix-oracle"],
        metadata={"help": "What each round's eval runs (eval.n for greedy, eval.n_other for the others)."},
    )

    def __post_init__(self) -> None:
        problems = []
        if self.count < 1:
            problems.append(f"count must be >= 1, got {self.count}")
        if not self.decoders:
            problems.append("decoders must name at least one decoder")
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
                  "this (the tiny recipe trains on up to 20). One more step (4) was tried first: the base scored "
                  "1.7% there, a floor that cannot show forgetting; numbers up to 30 give the base 25.7% (n=300)."},
    )
    drift_n: int = field(default=200, metadata={"help": "Test prompts on which KL(tuned ‖ base) is measured."})

    def __post_init__(self) -> None:
        problems = []
        unknown = [a for a in [*self.main_arms, *self.other_arms] if a not in ARMS]
        if unknown:
            problems.append(f"unknown arms {unknown}; known: {', '.join(ARMS)}")
        if not self.seeds:
            problems.append("seeds must list at least one seed")
        if self.n < 1 or self.drift_n < 1 or self.variant_number_max < 2:
            problems.append("n and drift_n must be >= 1, variant_number_max >= 2")
        if problems:
            raise ValueError("; ".join(problems))


def _check_name(config: Config) -> None:
    # The run folder defaults to runs/<name>: a name with a path in it would write outside runs/.
    if config.name and not _SAFE_NAME.fullmatch(config.name):
        raise ValueError(f"name {config.name!r} must be letters, digits, '.', '_' or '-' (it names the folder "
                         "runs/<name>); use --run-dir to choose another folder")


def _section(cls: type) -> dataclasses.Field:
    return field(default_factory=cls)


# The recipe's sections in order; the decoders' sections (redumix, moi, cntp, pdr, reflective) come from their table.
Config = dataclasses.make_dataclass(
    "Config",
    [
        ("name", str, field(default="", metadata={"help": "Run name; defaults to the recipe file's stem."})),
        ("seed", int, field(
            default=0,
            metadata={"help": "The run's one seed: which problems, the base's and trainer's initialisation and data "
                      "order, and every example's sampling noise (each example derives its own from it and its id)."},
        )),
        ("model", ModelConfig, _section(ModelConfig)),
        ("base", BaseConfig, _section(BaseConfig)),
        ("task", TaskConfig, _section(TaskConfig)),
        ("sampling", SamplingPolicy, _section(SamplingPolicy)),
        *[(key, cls, _section(cls)) for key, cls in decoder_sections().items()],
        ("harvest", HarvestConfig, _section(HarvestConfig)),
        ("train", TrainConfig, _section(TrainConfig)),
        ("eval", EvalConfig, _section(EvalConfig)),
        ("rounds", RoundsConfig, _section(RoundsConfig)),
        ("evidence", EvidenceConfig, _section(EvidenceConfig)),
    ],
    namespace={"__post_init__": _check_name},
)
Config.__module__ = __name__


def load_config(recipe: str | Path | None, overrides: list[str] = ()) -> Config:
    """Defaults <- recipe YAML <- overrides (pipeline/resolve.py). Raises ConfigError listing every problem."""
    config = resolve(Config, recipe, overrides)
    if not config.name:
        config.name = Path(recipe).stem if recipe is not None else "default"
    return config
