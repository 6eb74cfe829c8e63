"""`redumix eval`: rerun the decoders on base and tuned checkpoints and report accuracy and compute."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EvalConfig:
    n: int = field(default=500, metadata={"help": "Held-out examples for greedy decoding."})
