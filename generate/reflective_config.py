"""The settings of Reflective Decoding (`reflective.py`): the gate, trigger points, how a reflection ends, the
hidden policy, the markers, and the ablations. `redumix.generate.reflective` imports `ReflectiveConfig` too."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

GateKind = Literal["norm_entropy", "entropy", "one_minus_pmax", "margin", "topk_entropy"]
Ablation = Literal["gate", "periodic", "random", "fixed"]
StopRule = Literal["end_marker", "peek", "peek_agree"]
STOP_RULES: tuple[StopRule, ...] = ("end_marker", "peek", "peek_agree")


@dataclass
class ReflectiveConfig:
    gate: GateKind = field(
        default="norm_entropy",
        metadata={
            "help": "Uncertainty u of the visible policy: entropy normalised by log|S| (in [0,1]), raw "
            "entropy (nats), 1-p_max, margin (p_2/p_1, 1 = tie) or entropy of the top gate_top_k."
        },
    )
    gate_top_k: int = field(default=10, metadata={"help": "k of the topk_entropy gate."})
    tau_high: float = field(default=0.65, metadata={"help": "Trigger when uncertainty exceeds this."})
    tau_low: float = field(default=0.45, metadata={"help": "Re-arm the gate once uncertainty falls below this."})
    tau_stop: float = field(
        default=0.45, metadata={"help": "End a reflection once the peek's uncertainty after R_END is at most this."}
    )
    reflect_temperature: float = field(
        default=0.0, metadata={"help": "Temperature of the hidden reflection policy (0 = greedy)."}
    )
    reflect_top_p: float = field(default=0.95, metadata={"help": "Top-p of the hidden reflection policy."})
    reflect_length: int = field(default=48, metadata={"help": "L_reflect: most hidden tokens in one reflection."})
    budget_total: int = field(default=128, metadata={"help": "B_total: most hidden tokens per example."})
    cooldown: int = field(default=4, metadata={"help": "Visible tokens after a reflection before another may start."})
    ablation: Ablation = field(
        default="gate",
        metadata={
            "help": "gate: uncertainty-gated, ended by `stop`; periodic: every `period` visible tokens; random: "
            "with probability random_rate per visible step; both at trigger points only and ended by `stop`; "
            "fixed: gated, no stop of any kind (always reflect_length hidden tokens)."
        },
    )
    stop: StopRule = field(
        default="end_marker",
        metadata={
            "help": "What ends a reflection before reflect_length/budget_total. end_marker: only the model's own "
            "R_END (needs single-id markers; no peeks are fed). peek: the seed's peek, u after R_END <= tau_stop, "
            "or the model's R_END. peek_agree: a confident peek that begins the result of the check the span just "
            "finished (check_result), or the model's R_END."
        },
    )
    check_result: str = field(
        default=r"=\s*(\d+)\s*$",
        metadata={
            "help": "peek_agree: regex searched in the decoded hidden span; it must match at a finished check and "
            "its one group is the check's result."
        },
    )
    trigger_after: list[str] = field(
        default_factory=list,
        metadata={
            "help": "A reflection may start only where the visible text so far ends with one of these strings "
            "(e.g. [' = ']); [] = anywhere. Holds for the gate and the periodic/random ablations alike."
        },
    )
    period: int = field(
        default=16,
        metadata={"help": "periodic ablation: visible tokens between reflections (then the next trigger point)."},
    )
    random_rate: float = field(
        default=0.1, metadata={"help": "random ablation: trigger probability per visible step at a trigger point."}
    )
    dual_path: bool = field(
        default=True, metadata={"help": "Run each hidden step and its peek in one forward pass (else two)."}
    )
    model_may_end: bool = field(
        default=True,
        metadata={"help": "A sampled single-id R_END ends the reflection (models trained on check spans)."},
    )
    marker_start: str = field(default="<|reflect|>", metadata={"help": "R_START if the tokenizer has it as one id."})
    marker_end: str = field(default="<|/reflect|>", metadata={"help": "R_END if the tokenizer has it as one id."})
    reflection_only_tokens: list[str] = field(
        default_factory=list, metadata={"help": "Tokens allowed inside reflections only (banned when visible)."}
    )
    audit: bool = field(
        default=False, metadata={"help": "Keep hidden tokens and markers in the results (never on by default)."}
    )
    calibrate_rate: float = field(
        default=0.1, metadata={"help": "`redumix calibrate`: target reflections per visible token."}
    )

    def __post_init__(self) -> None:
        problems = []
        if self.tau_low > self.tau_high:
            problems.append(f"tau_low ({self.tau_low}) must be <= tau_high ({self.tau_high})")
        if self.gate_top_k < 2:
            problems.append(f"gate_top_k must be >= 2, got {self.gate_top_k}")
        if self.reflect_temperature < 0:
            problems.append(f"reflect_temperature must be >= 0, got {self.reflect_temperature}")
        if not 0 < self.reflect_top_p <= 1:
            problems.append(f"reflect_top_p must be in (0, 1], got {self.reflect_top_p}")
        if self.reflect_length < 1:
            problems.append(f"reflect_length must be >= 1, got {self.reflect_length}")
        if self.budget_total < 0:
            problems.append(f"budget_total must be >= 0, got {self.budget_total}")
        if self.cooldown < 0:
            problems.append(f"cooldown must be >= 0, got {self.cooldown}")
        if self.period < 1:
            problems.append(f"period must be >= 1, got {self.period}")
        if not 0 <= self.random_rate <= 1:
            problems.append(f"random_rate must be in [0, 1], got {self.random_rate}")
        if not 0 < self.calibrate_rate < 1:
            problems.append(f"calibrate_rate must be in (0, 1), got {self.calibrate_rate}")
        if self.stop not in STOP_RULES:
            problems.append(f"stop must be one of {', '.join(STOP_RULES)}, got {self.stop!r}")
        if self.stop == "end_marker" and not self.model_may_end and self.ablation != "fixed":
            problems.append("stop='end_marker' needs model_may_end=True (the model's R_END is its only stop); "
                            "for fixed-length reflections use ablation='fixed'")
        try:
            groups = re.compile(self.check_result).groups
        except re.error as exc:
            problems.append(f"check_result {self.check_result!r} is not a valid regex ({exc})")
        else:
            if groups != 1:
                problems.append(f"check_result must have exactly one group (the result), got {groups}")
        if any(not isinstance(s, str) or not s for s in self.trigger_after):
            problems.append(f"trigger_after must hold non-empty strings, got {self.trigger_after!r}")
        if problems:
            raise ValueError("; ".join(problems))
