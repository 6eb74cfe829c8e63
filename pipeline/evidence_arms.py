"""The arms of `redumix evidence` by name: which harvest each learns from and how it trains, with one line of help.

A module of its own, with no torch in it, so that the config checks `evidence.main_arms` and `evidence.other_arms`
and writes their help from this table without importing the stage (pipeline/studies/evidence.py runs the arms).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Arm:
    harvest: str  # the harvest it learns from, a key of HARVESTS
    train: dict[str, Any]  # its train.* settings over the recipe's
    help: str


ARMS: dict[str, Arm] = {
    "mixture": Arm("verifier", {}, "the stored p_mix at the recipe's λ, verifier feedback: the product's own target"),
    "lambda0": Arm("lambda0", {}, "p_mix at λ=0, the reflective context alone (a harvest of its own)"),
    "redo": Arm("verifier", {"target": "redo"}, "SFT: the λ-mixture redo text as hard labels"),
    # Every row: the reference is right whatever the row's redo was, so a recipe's `train.rows` does not thin it.
    "gold": Arm("verifier", {"target": "gold", "rows": "all"},
                "SFT: the task's reference working on every row (what a perfect teacher gives)"),
    "original": Arm("verifier", {"target": "original"},
                    "SFT: the model's own first attempts (what any fine-tune on this data gives)"),
    "rft": Arm("rft", {"target": "original", "rows": "original_correct"},
               "RFT (rejection-sampling fine-tuning): SFT on the model's own right answers, its first attempt and "
               "evidence.rft_samples samples a problem"),
    "feedback-self": Arm("self", {}, "p_mix from a harvest whose feedback is the model's own critique"),
    "feedback-none": Arm("none", {}, "p_mix from a harvest with no feedback at all (reflect only)"),
    "feedback-random": Arm("random", {}, "p_mix from a harvest with a coin-flip verdict, wrong half the time"),
    "on-policy": Arm("verifier", {"policy": "on_policy"}, "student samples, the teacher's p_mix computed live"),
    "sdft-base": Arm("verifier", {"method": "sdft", "sdft_teacher": "base"},
                     "TRL's SDFT: student samples, taught by the starting model shown x2 (no p_mix, no λ)"),
    "sdft-ema": Arm("verifier", {"method": "sdft", "sdft_teacher": "ema"},
                    "TRL's SDFT: student samples, taught by an EMA of the student shown x2"),
}

# Harvest kinds: the recipe's own ("verifier", RUN_DIR/harvest), or one redumix setting changed.
HARVESTS: dict[str, dict[str, Any]] = {
    "verifier": {},
    "lambda0": {"lam": 0.0},
    "self": {"feedback": "self"},
    "none": {"feedback": "none"},
    "random": {"feedback": "random"},
    "rft": {},  # the recipe's own, with the model's right samples added (pipeline/studies/rft.py)
}


def arms_help() -> str:
    return "; ".join(f"{name}: {arm.help}" for name, arm in ARMS.items())
