"""`redumix base`: build the embedded default model (tokenizer + tiny Llama trained on arith)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BaseConfig:
    steps: int = field(default=1600, metadata={"help": "Optimizer steps of base pre-training."})
