"""Parallel-Distill-Refine and Sequential Refinement (shared/seeds/parallel-distill-refine.txt)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PdrConfig:
    drafts: int = field(default=4, metadata={"help": "N drafts per round (1 = Sequential Refinement)."})
    rounds: int = field(default=2, metadata={"help": "R refine rounds."})
    workspace_tokens: int = field(default=192, metadata={"help": "W: the distilled workspace's token bound."})
