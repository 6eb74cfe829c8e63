"""Mixture of Inputs (shared/seeds/mixture-of-inputs.txt)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MoiConfig:
    beta: float = field(default=1.0, metadata={"help": "Concentration β: larger trusts the sampled token more."})
    topk: int = field(default=20, metadata={"help": "p is the policy renormalised over its top-k tokens."})
