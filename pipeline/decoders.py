"""The decoders by name: one table, and everything that lists decoders reads it.

Each decoder is a module of generate/ holding its settings dataclass and the decoder. Its line in `DECODERS` gives
the config section it reads (`config.redumix`, ...: `Config` gets one section per key named here), the factory that
builds it from the resolved config, the suffix its name may take (`redumix-oracle@0.3`, `vote@8`), and one line of
help. `eval.decoders`' help and default, the `@` suffixes and the "known:" message are derived from the table. A
decoder that needs more than the checkpoint (a second model) stays out of eval's default run (`default=False`).

The factories live here, not in generate/, because they read the whole Config (a decoder's own section, the shared
sampling policy, the seed) and generate/ knows nothing of stages or recipes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from redumix.generate.cntp import CntpConfig, CntpDecoder
from redumix.generate.decoder import Decoder
from redumix.generate.model_io import ModelConfig
from redumix.generate.moi import MoiConfig, MoiDecoder
from redumix.generate.pdr import PdrConfig, PdrDecoder
from redumix.generate.plain import PlainDecoder
from redumix.generate.policy import SamplingPolicy
from redumix.generate.redumix import RedumixConfig, RedumixDecoder
from redumix.generate.reflective import ReflectiveConfig, ReflectiveDecoder
from redumix.generate.reflective_tuning import matched_ablations
from redumix.generate.report_details import GUIDE, REDO, REFINE, REFLECTION, ReportDetails
from redumix.generate.speculative import GuideGreedyDecoder, SpeculativeConfig, SpeculativeDecoder
from redumix.pipeline.lineage import model_id
from redumix.pipeline.run import in_repo


class _EvalSettings(Protocol):
    @property
    def sample_temperature(self) -> float: ...


class Config(Protocol):
    """What the factories read of the resolved config (pipeline/config.py's `Config` has all of it). A protocol, so
    that this table, which Config's eval section takes its default and help from, never imports Config back."""

    @property
    def seed(self) -> int: ...
    @property
    def model(self) -> ModelConfig: ...
    @property
    def sampling(self) -> SamplingPolicy: ...
    @property
    def eval(self) -> _EvalSettings: ...
    @property
    def redumix(self) -> RedumixConfig: ...
    @property
    def moi(self) -> MoiConfig: ...
    @property
    def cntp(self) -> CntpConfig: ...
    @property
    def pdr(self) -> PdrConfig: ...
    @property
    def reflective(self) -> ReflectiveConfig: ...
    @property
    def speculative(self) -> SpeculativeConfig: ...


# (config, the decoder's name as listed, records of the decoders already run on this checkpoint) -> decoder
DecoderFactory = Callable[[Config, str, dict[str, list[dict]]], Decoder]


@dataclass(frozen=True)
class DecoderEntry:
    section: tuple[str, type] | None  # (key, dataclass) of the config section it reads, or None
    make: DecoderFactory
    suffix: str  # what may follow its name after '@' ("@λ", "@N"), or "" for nothing
    help: str
    default: bool = True  # in eval's default run
    details: ReportDetails | None = None  # what its records' `extra` adds to its report row


# The decoder every other decoder is compared with, on the examples both scored (eval's paired columns).
BASELINE = "greedy"


def family(name: str) -> str:
    """The table's name of a decoder as listed (`redumix-oracle@0.3` -> `redumix-oracle`)."""
    return name.partition("@")[0]


# --- factories ------------------------------------------------------------------------------------------------------


def _greedy(config: Config, name: str, earlier: dict[str, list[dict]]) -> Decoder:
    return PlainDecoder(name, dataclasses.replace(config.sampling, temperature=0.0), config.seed)


def _sample(config: Config, name: str, earlier: dict[str, list[dict]]) -> Decoder:
    policy = dataclasses.replace(config.sampling, temperature=config.eval.sample_temperature)
    return PlainDecoder(name, policy, config.seed)


def _longhand(config: Config, name: str, earlier: dict[str, list[dict]]) -> Decoder:
    return PlainDecoder(name, dataclasses.replace(config.sampling, temperature=0.0), config.seed, longhand=True)


def _redumix(feedback: str) -> DecoderFactory:
    def make(config: Config, name: str, earlier: dict[str, list[dict]]) -> Decoder:
        settings = dataclasses.replace(config.redumix, feedback=feedback)
        _, at, lam = name.partition("@")
        if at:
            try:
                settings = dataclasses.replace(settings, lam=float(lam))
            except ValueError as exc:
                raise ValueError(f"eval.decoders: {name!r}: λ must be a number in [0, 1] ({exc})") from exc
        return RedumixDecoder(name, settings, config.sampling, config.seed)

    return make


def _moi(config: Config, name: str, earlier: dict[str, list[dict]]) -> Decoder:
    return MoiDecoder(name, config.moi, config.sampling, config.seed)


def _cntp(config: Config, name: str, earlier: dict[str, list[dict]]) -> Decoder:
    return CntpDecoder(name, config.cntp, dataclasses.replace(config.sampling, temperature=0.0), config.seed)


def _vote(config: Config, name: str, earlier: dict[str, list[dict]]) -> Decoder:
    """Self-consistency at PDR's N and draft temperature: PDR with no refine round is exactly a majority vote."""
    _, at, count = name.partition("@")
    drafts = config.pdr.drafts
    if at:
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"eval.decoders: {name!r}: N must be a whole number >= 1")
        drafts = int(count)
    return PdrDecoder(name, dataclasses.replace(config.pdr, drafts=drafts, rounds=0), config.sampling, config.seed)


def _pdr(config: Config, name: str, earlier: dict[str, list[dict]]) -> Decoder:
    return PdrDecoder(name, config.pdr, config.sampling, config.seed)


def _sr(config: Config, name: str, earlier: dict[str, list[dict]]) -> Decoder:
    return PdrDecoder(name, dataclasses.replace(config.pdr, drafts=1), config.sampling, config.seed)


def _reflective(config: Config, name: str, earlier: dict[str, list[dict]]) -> Decoder:
    return ReflectiveDecoder(name, config.reflective, config.sampling, config.seed)


def _matched(config: Config, name: str, earlier: dict[str, list[dict]]) -> Decoder:
    """An ablation of the gated reflective run, matched to its hidden budget."""
    gated = earlier.get("reflective")
    if not gated:
        raise ValueError(f"eval.decoders: {name!r} is matched to 'reflective', so list 'reflective' before it")
    visible = sum(r["extra"]["visible_tokens"] for r in gated)
    reflections = sum(r["extra"]["n_reflections"] for r in gated)
    hidden = sum(r["extra"]["hidden_tokens"] for r in gated)
    points = sum(r["extra"]["trigger_points"] for r in gated)  # where a trigger could fire (trigger_after)
    settings = matched_ablations(config.reflective, visible, reflections, hidden, points)[name]
    return ReflectiveDecoder(name, settings, config.sampling, config.seed)


def _guide(config: Config) -> tuple[str, str]:
    """The guide's folder, resolved as `embedded.shipped` is (a relative path missing here is read from the
    repository), and its identity."""
    if config.speculative.guide_path is None:
        raise ValueError("speculative.guide_path is not set: the speculative decoders and guide-greedy need a guide "
                         "model folder (the same tokenizer as model.path, a larger model)")
    folder = in_repo(config.speculative.guide_path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"speculative.guide_path={config.speculative.guide_path}: no model there (expected a Hugging "
                         "Face folder with config.json)")
    return str(folder), model_id(folder) or ""


def _speculative(config: Config, name: str, earlier: dict[str, list[dict]]) -> Decoder:
    policy = dataclasses.replace(config.sampling, temperature=0.0)
    return SpeculativeDecoder(name, config.speculative, policy, config.seed, *_guide(config),
                              config.model.trust_remote_code)


def _speculative_random(config: Config, name: str, earlier: dict[str, list[dict]]) -> Decoder:
    """The random-trigger ablation at speculative-thinking's guide budget: a handover at each delimiter point with
    probability (its handovers) / (its delimiter points), so the guide gets as many steps on average."""
    guided = earlier.get("speculative-thinking")
    if not guided:
        raise ValueError(f"eval.decoders: {name!r} is matched to 'speculative-thinking', so list "
                         "'speculative-thinking' before it")
    steps = sum(r["extra"]["guide_steps"] for r in guided)
    points = sum(r["extra"]["delimiter_points"] for r in guided)
    settings = dataclasses.replace(config.speculative, random_rate=min(1.0, steps / max(1, points)))
    policy = dataclasses.replace(config.sampling, temperature=0.0)
    return SpeculativeDecoder(name, settings, policy, config.seed, *_guide(config), config.model.trust_remote_code)


def _guide_greedy(config: Config, name: str, earlier: dict[str, list[dict]]) -> Decoder:
    policy = dataclasses.replace(config.sampling, temperature=0.0)
    return GuideGreedyDecoder(name, policy, config.seed, *_guide(config), config.model.trust_remote_code)


# --- the table ------------------------------------------------------------------------------------------------------

REDUMIX = ("redumix", RedumixConfig)
MOI = ("moi", MoiConfig)
CNTP = ("cntp", CntpConfig)
PDR = ("pdr", PdrConfig)
REFLECTIVE = ("reflective", ReflectiveConfig)
SPECULATIVE = ("speculative", SpeculativeConfig)

# name -> (config section, factory, suffix, help). The order is the order of eval's default run and of the config's
# decoder sections. A decoder's name salts its sampling seed: renaming one changes its records.
DECODERS: dict[str, DecoderEntry] = {
    "greedy": DecoderEntry(None, _greedy, "", "plain greedy decoding"),
    "sample": DecoderEntry(None, _sample, "", "plain sampling at eval.sample_temperature"),
    "longhand": DecoderEntry(None, _longhand, "", "greedy, asked to work the long way (visible long-hand CoT)"),
    "redumix-oracle": DecoderEntry(REDUMIX, _redumix("verifier"), "@λ",
                                   "ReDuMix with the task's verifier feedback (it knows the answer); @λ sets λ",
                                   details=REDO),
    "redumix-self": DecoderEntry(REDUMIX, _redumix("self"), "@λ", "ReDuMix with the model's own critique as feedback",
                                 details=REDO),
    "moi": DecoderEntry(MOI, _moi, "", "Mixture of Inputs"),
    "cntp": DecoderEntry(CNTP, _cntp, "", "Cautious Next Token Prediction: lowest-perplexity trial where unsure"),
    "vote": DecoderEntry(PDR, _vote, "@N", "self-consistency: majority of N sampled answers (pdr.drafts)",
                         details=REFINE),
    "pdr": DecoderEntry(PDR, _pdr, "", "Parallel-Distill-Refine", details=REFINE),
    "sr": DecoderEntry(PDR, _sr, "", "Sequential Refinement: PDR with one draft", details=REFINE),
    "reflective": DecoderEntry(REFLECTIVE, _reflective, "", "hidden-KV Reflective Decoding, gated by uncertainty",
                               details=REFLECTION),
    "reflective-periodic": DecoderEntry(REFLECTIVE, _matched, "", "ablation: reflect periodically (after reflective)",
                                        details=REFLECTION),
    "reflective-random": DecoderEntry(REFLECTIVE, _matched, "", "ablation: reflect at random (after reflective)",
                                      details=REFLECTION),
    "reflective-fixed": DecoderEntry(REFLECTIVE, _matched, "", "ablation: one fixed-length span (after reflective)",
                                     details=REFLECTION),
    "guide-greedy": DecoderEntry(SPECULATIVE, _guide_greedy, "", "greedy by the guide model alone "
                                 "(needs speculative.guide_path; not run by default)", default=False, details=GUIDE),
    "speculative-thinking": DecoderEntry(SPECULATIVE, _speculative, "", "Speculative Thinking: a guide model writes "
                                         "the steps that open reflectively (needs speculative.guide_path; not run "
                                         "by default)", default=False, details=GUIDE),
    "speculative-random": DecoderEntry(SPECULATIVE, _speculative_random, "", "ablation: random handovers at its "
                                       "guide budget (after speculative-thinking; not run by default)",
                                       default=False, details=GUIDE),
}

# Eval's default: every decoder but those that need a second model, with the oracle at λ = 1 (plain decoding), the
# recipe's λ and 0 (the reflective context alone).
LAMBDA_SWEEP = {"redumix-oracle": ["redumix-oracle@1", "redumix-oracle", "redumix-oracle@0"]}
DEFAULT_DECODERS = [run for name, entry in DECODERS.items() if entry.default for run in LAMBDA_SWEEP.get(name, [name])]


def decoder_sections(table: dict[str, DecoderEntry] = DECODERS) -> dict[str, type]:
    """The config sections the decoders read, key -> dataclass, in table order (each key names one dataclass)."""
    sections: dict[str, type] = {}
    for name, entry in table.items():
        if entry.section is None:
            continue
        key, cls = entry.section
        if sections.setdefault(key, cls) is not cls:
            raise TypeError(f"decoder {name!r}: section {key!r} is {sections[key].__name__} for an earlier decoder")
    return sections


def known_decoders(table: dict[str, DecoderEntry] = DECODERS) -> str:
    return ", ".join(name + (f"[{entry.suffix}]" if entry.suffix else "") for name, entry in table.items())


def decoders_help(table: dict[str, DecoderEntry] = DECODERS) -> str:
    return "; ".join(f"{name}{f'[{e.suffix}]' if e.suffix else ''}: {e.help}" for name, e in table.items())


def check_decoder_names(names: list[str], table: dict[str, DecoderEntry] = DECODERS) -> None:
    """Every listed name must be in the table before any model loads; all problems are reported at once."""
    problems = []
    for name in names:
        family, at, _ = name.partition("@")
        if family not in table:
            problems.append(f"unknown decoder {name!r} (known: {known_decoders(table)})")
        elif at and not table[family].suffix:
            takes = ", ".join(f"{k}{e.suffix}" for k, e in table.items() if e.suffix)
            problems.append(f"decoder {name!r}: only these take an @ suffix: {takes}")
    if problems:
        raise ValueError("eval.decoders: " + "; ".join(problems))


def make_decoder(
    config: Config, name: str, earlier: dict[str, list[dict]], table: dict[str, DecoderEntry] = DECODERS
) -> Decoder:
    """The decoder listed as `name` (a suffix included), built by its table entry."""
    return table[family(name)].make(config, name, earlier)
