"""Config: dataclass defaults, then a YAML recipe, then `key.sub=value` overrides from the command line.

Every section is a dataclass that lives next to the code it configures (the sampling policy in
`generate/policy.py`, the task in `data/tasks.py`, ...). This module only composes them and resolves a recipe.
Unknown keys, wrong types and out-of-range values are all collected and reported together, each naming the
recipe file (or the command line) and the dotted key.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from redumix.data.task import TaskConfig
from redumix.embedded.config import BaseConfig
from redumix.generate.cntp import CntpConfig
from redumix.generate.moi import MoiConfig
from redumix.generate.pdr import PdrConfig
from redumix.generate.policy import SamplingPolicy
from redumix.generate.redumix import RedumixConfig
from redumix.generate.reflective import ReflectiveConfig
from redumix.train.config import TrainConfig

_SAFE_NAME = re.compile(r"(?!\.{1,2}$)[A-Za-z0-9._-]+")


class ConfigError(ValueError):
    """A recipe or override is wrong. The message lists every problem, one per line."""


@dataclass
class ModelConfig:
    path: str = field(
        default="base",
        metadata={"help": "'base' is the embedded default built by `redumix base` in RUN_DIR/base; "
                  "otherwise a local Hugging Face model folder."},
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Run model code shipped with the checkpoint."})
    dtype: Literal["float32", "bfloat16", "float16"] = field(default="float32", metadata={"help": "Weights dtype."})
    device: str = field(default="auto", metadata={"help": "'auto' picks cuda:LOCAL_RANK when available, else cpu."})
    compile_decoding: bool = field(
        default=False,
        metadata={"help": "Run each one-token decode step through torch.compile (harvest, eval, calibrate): "
                  "about 2x faster a step for a small model on a CPU, after a one-off compile of 15-60 s a process "
                  "(for a 30-layer model 1-5 minutes, and on a CPU its compiled step is slower than the eager one)."},
    )


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


DEFAULT_DECODERS = [
    "greedy", "sample", "longhand", "redumix-oracle@1", "redumix-oracle", "redumix-oracle@0", "redumix-self", "moi",
    "cntp", "vote", "pdr", "sr", "reflective", "reflective-periodic", "reflective-random", "reflective-fixed",
]


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
        metadata={"help": "Decoders to run, by name (pipeline/eval.py's DECODERS; `redumix-oracle@λ` sets λ). "
                  "An ablation `reflective-*` is matched to `reflective`, which must come before it."},
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


EVIDENCE_ARMS = ["mixture", "lambda0", "redo", "gold", "original", "feedback-self", "feedback-none",
                 "feedback-random", "on-policy"]


@dataclass
class EvidenceConfig:
    seeds: list[int] = field(
        default_factory=lambda: [0, 1, 2],
        metadata={"help": "Trainer seeds (train.seed) of the main arms; the other arms train with the first."},
    )
    main_arms: list[str] = field(
        default_factory=lambda: ["mixture", "lambda0", "redo", "gold", "original"],
        metadata={"help": f"Arms trained with every seed. Known arms: {', '.join(EVIDENCE_ARMS)}."},
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
        unknown = [a for a in [*self.main_arms, *self.other_arms] if a not in EVIDENCE_ARMS]
        if unknown:
            problems.append(f"unknown arms {unknown}; known: {', '.join(EVIDENCE_ARMS)}")
        if not self.seeds:
            problems.append("seeds must list at least one seed")
        if self.n < 1 or self.drift_n < 1 or self.variant_number_max < 2:
            problems.append("n and drift_n must be >= 1, variant_number_max >= 2")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class Config:
    name: str = field(default="", metadata={"help": "Run name; defaults to the recipe file's stem."})
    seed: int = field(
        default=0,
        metadata={"help": "The run's one seed: which problems, the base's and trainer's initialisation and data "
                  "order, and every example's sampling noise (each example derives its own from it and its id)."},
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    base: BaseConfig = field(default_factory=BaseConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sampling: SamplingPolicy = field(default_factory=SamplingPolicy)
    redumix: RedumixConfig = field(default_factory=RedumixConfig)
    moi: MoiConfig = field(default_factory=MoiConfig)
    cntp: CntpConfig = field(default_factory=CntpConfig)
    pdr: PdrConfig = field(default_factory=PdrConfig)
    reflective: ReflectiveConfig = field(default_factory=ReflectiveConfig)
    harvest: HarvestConfig = field(default_factory=HarvestConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rounds: RoundsConfig = field(default_factory=RoundsConfig)
    evidence: EvidenceConfig = field(default_factory=EvidenceConfig)


# --- resolution ---------------------------------------------------------------------------------------------------


def load_config(recipe: str | Path | None, overrides: list[str] = ()) -> Config:
    """Resolve defaults <- recipe YAML <- overrides. Raises ConfigError listing every problem."""
    errors: list[str] = []
    raw: dict[str, Any] = {}
    origin: dict[str, str] = {}  # dotted key -> where its value came from, for error messages
    if recipe is not None:
        recipe = Path(recipe)
        if not recipe.is_file():
            raise ConfigError(
                f"recipe not found: {recipe} (pass --recipe PATH to a YAML file, e.g. recipes/tiny.yaml)"
            )
        try:
            loaded = yaml.safe_load(recipe.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(_yaml_error(recipe, exc)) from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"{recipe}: the top level must be a mapping of sections, got {type(loaded).__name__}")
        raw = loaded
        _record_origin(raw, str(recipe), "", origin)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            errors.append(f"command line: override {item!r} is not of the form key.sub=value")
            continue
        _set_dotted(raw, key.strip(), yaml.safe_load(text) if text.strip() else "", errors)
        origin[key.strip()] = "command line"
    config = _build(Config, raw, "", origin, errors)
    if config.name and not _SAFE_NAME.fullmatch(config.name):
        # The run folder defaults to runs/<name>: a name with a path in it would write outside runs/.
        errors.append(f"{_where(origin, 'name')}: 'name' = {config.name!r} must be letters, digits, '.', '_' or '-' "
                      "(it names the folder runs/<name>); use --run-dir to choose another folder")
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    if not config.name:
        config.name = recipe.stem if recipe is not None else "default"
    return config


def _yaml_error(recipe: Path, exc: yaml.YAMLError) -> str:
    """`FILE:LINE: not valid YAML (what, and where the construct it broke began); fix ...`."""
    mark = getattr(exc, "problem_mark", None)
    if mark is None:
        return f"{recipe}: not valid YAML ({exc}); fix the file"
    problem = getattr(exc, "problem", None) or "syntax error"
    context, began = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and began is not None:
        problem += f", {context} from line {began.line + 1}"
    return f"{recipe}:{mark.line + 1}: not valid YAML ({problem}); fix the YAML there"


def config_to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def config_to_yaml(config: Any) -> str:
    return yaml.safe_dump(config_to_dict(config), sort_keys=False)


def _record_origin(raw: dict, where: str, prefix: str, origin: dict[str, str]) -> None:
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        origin[dotted] = where
        if isinstance(value, dict):
            _record_origin(value, where, dotted + ".", origin)


def _set_dotted(raw: dict, dotted: str, value: Any, errors: list[str]) -> None:
    node = raw
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            errors.append(f"command line: {dotted!r}: {part!r} is a value, not a section")
            return
        node = child
    node[parts[-1]] = value


def _where(origin: dict[str, str], dotted: str) -> str:
    inside = sorted({where for key, where in origin.items() if key.startswith(dotted + ".")}) if dotted else []
    if dotted not in origin and inside:
        return " and ".join(inside)
    while dotted and dotted not in origin:
        dotted = dotted.rpartition(".")[0]
    return origin.get(dotted, "defaults")


def _build(cls: type, raw: Any, prefix: str, origin: dict[str, str], errors: list[str]) -> Any:
    if not isinstance(raw, dict):
        errors.append(f"{_where(origin, prefix.rstrip('.'))}: {prefix.rstrip('.')!r} must be a mapping")
        return cls()
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in raw:
        if key not in known:
            dotted = prefix + str(key)
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {prefix + close[0]!r}?)" if close else f" (known: {', '.join(known)})"
            errors.append(f"{_where(origin, dotted)}: unknown key {dotted!r}{hint}")
    kwargs = {}
    for name in known:
        if name not in raw:
            continue
        dotted = prefix + name
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, raw[name], dotted + ".", origin, errors)
        else:
            ok, value = _coerce(raw[name], hint)
            if ok:
                kwargs[name] = value
            else:
                errors.append(f"{_where(origin, dotted)}: {dotted!r} = {raw[name]!r} is not {_type_name(hint)}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        # The check names fields, not where they were set: find the given keys it names, to point at them.
        named = [prefix + name for name in known if name in raw and re.search(rf"\b{name}\b", str(exc))]
        if named:
            where = " and ".join(sorted({_where(origin, dotted) for dotted in named}))
            errors.append(f"{where}: {', '.join(repr(d) for d in named)}: {exc}")
        else:
            section = prefix.rstrip(".")
            errors.append(f"{_where(origin, section)}: section {section or 'top level'!r}: {exc}")
        return cls()


def _coerce(value: Any, hint: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return True, value
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            ok, out = _coerce(value, arg)
            if ok:
                return True, out
        return False, None
    if hint is type(None):
        return value is None, None
    if origin is Literal:
        return (value in args), value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False, None
        inner = args[0] if args else Any
        out = []
        for item in value:
            ok, item_value = _coerce(item, inner)
            if not ok:
                return False, None
            out.append(item_value)
        return True, out
    if origin is dict:
        return isinstance(value, dict), value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return (isinstance(value, int) and not isinstance(value, bool)), value
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        return False, None
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return True, str(value)
        return False, None
    return isinstance(value, hint), value


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
