"""`redumix harvest`: run ReDuMix over a task split and write resumable Arrow shards."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class HarvestConfig:
    n: int = field(default=3000, metadata={"help": "Examples to harvest."})
    split: Literal["train", "test"] = field(default="train", metadata={"help": "Task split to harvest from."})
    batch_size: int = field(default=32, metadata={"help": "Examples decoded together."})
    shard_rows: int = field(default=256, metadata={"help": "Rows per Arrow shard (a shard is the unit of resume)."})
