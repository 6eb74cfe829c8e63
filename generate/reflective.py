"""Hidden-KV Reflective Decoding (shared/seeds/reflective-decoding.txt)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ReflectiveConfig:
    tau_high: float = field(default=0.65, metadata={"help": "Trigger when uncertainty exceeds this."})
    tau_low: float = field(default=0.45, metadata={"help": "Re-arm the gate once uncertainty falls below this."})
