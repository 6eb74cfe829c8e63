"""ReDuMix: attempt, feedback, reflection, then decoding under a per-token mixture of two contexts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class RedumixConfig:
    lam: float = field(default=0.5, metadata={"help": "λ: weight of the original context x (1 = plain decoding)."})
    topk: int = field(default=32, metadata={"help": "Top-k ids of p_mix stored per redo token."})
    feedback: Literal["verifier", "human", "self"] = field(
        default="verifier", metadata={"help": "Where r comes from: the task's answer check, a JSONL file, or the model."}
    )
    feedback_file: str = field(default="", metadata={"help": "human feedback: JSONL with 'id' and 'feedback'."})
    reflection_max_tokens: int = field(default=256, metadata={"help": "Most tokens in the reflection c."})
    critique_max_tokens: int = field(default=48, metadata={"help": "Most tokens in a self-critique r."})

    def __post_init__(self) -> None:
        if not 0 <= self.lam <= 1:
            raise ValueError(f"lam must be in [0, 1], got {self.lam}")
        if self.topk < 1:
            raise ValueError(f"topk must be >= 1, got {self.topk}")
