"""The run folder: where each stage of a run writes (files and processes are in redumix.common)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The repository (an editable install runs from it): bundled recipes and shipped models are found from here, so
# that `--recipe tiny` works from any directory.
REPO = Path(__file__).resolve().parents[1]
# model.path's name for the embedded default model, built in RUN_DIR/embedded (pipeline/embedded_stage.py).
EMBEDDED = "embedded"


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def embedded(self) -> Path:
        return self.root / "embedded"

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
    def ablation(self) -> Path:
        return self.root / "ablation"

    @property
    def evidence(self) -> Path:
        return self.root / "evidence"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def metrics(self) -> Path:
        return self.logs / "metrics.jsonl"


def arm_dir(study: Path, arm: str, seed: int) -> RunDir:
    """One arm's run folder for one seed in a study's folder (`RUN_DIR/evidence`, `RUN_DIR/ablation`)."""
    return RunDir(study / arm / f"seed-{seed}")


def in_repo(path: str | Path) -> Path:
    """A relative path missing here but present in the repository is the repository's (a bundled recipe, the shipped
    `models/tiny-base`, run from another directory); any other path as given."""
    given = Path(path)
    if not given.is_absolute() and not given.exists() and (REPO / given).exists():
        return REPO / given
    return given


def model_path(setting: str, run: RunDir) -> Path:
    """`embedded` names the embedded default model in the run folder; anything else is a local model folder."""
    if setting == EMBEDDED:
        return run.embedded
    if setting == "base" and not Path(setting).exists():
        raise ValueError("model.path=embedded: the embedded default model is now spelled model.path=embedded (and its "
                         "section `embedded:`); 'base' names the untuned checkpoint in eval's report")
    return Path(setting)
