"""Tuning Reflective Decoding: the gate's calibration to a target rate, and ablations matched to a gated run.

Both run the decoder in `reflective.py`; neither changes how it decodes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from redumix.generate.reflective import ReflectiveConfig, ReflectiveResult


@dataclass
class Calibration:
    tau_high: float
    tau_low: float
    tau_stop: float
    target_rate: float
    simulated_rate: float  # the gate replayed on plain-decoding uncertainty traces
    measured_rate: float  # reflections per visible token when decoding with the chosen thresholds
    visible_tokens: int  # visible tokens of the measuring run


def _replay_gate(traces: list[list[float]], tau_high: float, tau_low: float, cooldown: int) -> float:
    """Reflections per visible token if the gate (hysteresis, cooldown) saw these uncertainty traces."""
    triggers = steps = 0
    for trace in traces:
        armed, wait = True, 0
        for u in trace:
            steps += 1
            if armed and wait == 0 and u > tau_high:
                triggers, armed, wait = triggers + 1, False, cooldown
            wait = max(0, wait - 1)
            if u < tau_low:
                armed = True
    return triggers / max(1, steps)


def calibrate_tau(
    decode: Callable[[ReflectiveConfig], list[ReflectiveResult]],
    config: ReflectiveConfig,
    target_rate: float | None = None,
) -> Calibration:
    """Pick τ_high on dev prompts so that reflections start at `target_rate` per visible token.

    `decode(config)` runs Reflective Decoding with `config` on the same dev prompts each time.

    Decodes the prompts without reflections, replays the gate over their uncertainty traces for every candidate
    τ_high (τ_low and τ_stop keep the configured gap below it), and keeps the closest. The replay cannot see how
    reflections change what follows, so the chosen thresholds are then run for real and that rate is reported too.
    """
    target = config.calibrate_rate if target_rate is None else target_rate
    silent = dataclasses.replace(config, tau_high=math.inf, ablation="gate")
    plain = decode(silent)
    traces = [r.uncertainty for r in plain]
    values = sorted({u for t in traces for u in t})
    if not values:
        raise ValueError("calibration decoded no visible tokens")
    gap, stop_gap = config.tau_high - config.tau_low, config.tau_high - config.tau_stop
    candidates = [values[round(q * (len(values) - 1) / 200)] for q in range(201)]
    best = min(candidates, key=lambda t: abs(_replay_gate(traces, t, t - gap, config.cooldown) - target))
    tuned = dataclasses.replace(config, tau_high=best, tau_low=best - gap, tau_stop=best - stop_gap, ablation="gate")
    measured = decode(tuned)
    visible = sum(len(r.token_ids) for r in measured)
    return Calibration(
        tau_high=best,
        tau_low=tuned.tau_low,
        tau_stop=tuned.tau_stop,
        target_rate=target,
        simulated_rate=_replay_gate(traces, best, best - gap, config.cooldown),
        measured_rate=sum(r.n_reflections for r in measured) / max(1, visible),
        visible_tokens=visible,
    )


def matched_ablations(
    config: ReflectiveConfig, visible: int, reflections: int, hidden: int
) -> dict[str, ReflectiveConfig]:
    """Configs of the three ablations matched to a gated run's hidden budget.

    The gated run is summed up by its visible tokens, reflections and hidden tokens (eval keeps those per record).

    periodic and random trigger as often as the gate did (same reflections per visible token) and keep the peek
    stop; fixed keeps the gate but reflects for the gated run's mean reflection length, with no peek stop. All keep
    B_total and L_reflect, so hidden tokens per example stay comparable; report H beside each row.
    """
    rate = reflections / max(1, visible)
    mean_length = max(1, round(hidden / reflections)) if reflections else config.reflect_length
    return {
        "reflective-periodic": dataclasses.replace(
            config, ablation="periodic", period=max(1, round(1 / rate)) if rate else 10**9
        ),
        "reflective-random": dataclasses.replace(config, ablation="random", random_rate=min(1.0, rate)),
        "reflective-fixed": dataclasses.replace(config, ablation="fixed", reflect_length=mean_length),
    }
