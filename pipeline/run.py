"""The run folder: where each stage of a run writes (files and processes are in redumix.common)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def base(self) -> Path:
        return self.root / "base"

    @property
    def harvest(self) -> Path:
        return self.root / "harvest"

    @property
    def train(self) -> Path:
        return self.root / "train"

    @property
    def eval(self) -> Path:
        return self.root / "eval"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def metrics(self) -> Path:
        return self.logs / "metrics.jsonl"


def model_path(setting: str, run: RunDir) -> Path:
    """'base' names the embedded default in the run folder; anything else is a local model folder."""
    return run.base if setting == "base" else Path(setting)
