"""Config of the train stage (offline sparse-teacher GKD)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainConfig:
    beta: float = field(default=0.0, metadata={"help": "Generalized JSD β: 0 forward KL, 1 reverse KL."})
