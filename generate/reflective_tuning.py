"""Tuning Reflective Decoding: the gate's calibration to a target rate, the choice of the stop rule, and ablations
matched to a gated run.

All of them run the decode loop in `reflective_loop.py` through a callable they are given; none changes how it decodes.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from redumix.generate.reflective_config import STOP_RULES, ReflectiveConfig, StopRule
from redumix.generate.reflective_loop import ReflectiveResult


@dataclass
class Calibration:
    tau_high: float
    tau_low: float
    tau_stop: float
    target_rate: float
    simulated_rate: float  # the gate replayed on plain-decoding uncertainty traces
    measured_rate: float  # reflections per visible token when decoding with the chosen thresholds
    visible_tokens: int  # visible tokens of the measuring run


def _replay_gate(
    traces: list[list[float]], points: list[list[bool]], tau_high: float, tau_low: float, cooldown: int
) -> float:
    """Reflections per visible token if the gate (trigger points, hysteresis, cooldown) saw these traces."""
    triggers = steps = 0
    for trace, at_point in zip(traces, points, strict=True):
        armed, wait = True, 0
        for u, point in zip(trace, at_point, strict=True):
            steps += 1
            if point and armed and wait == 0 and u > tau_high:
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
    τ_high (τ_low and τ_stop keep the configured gap below it), and keeps the closest. With `trigger_after` the gate
    may fire only at trigger points, so the candidates are the u seen there and the replay fires only there; a
    target above the share of trigger points cannot be reached, and the lowest candidate (reflect at every point
    the cooldown allows) is kept. The replay cannot see how reflections change what follows, so the chosen
    thresholds are then run for real and that rate is reported too.
    """
    target = config.calibrate_rate if target_rate is None else target_rate
    silent = dataclasses.replace(config, tau_high=math.inf, ablation="gate")
    plain = decode(silent)
    traces, points = [r.uncertainty for r in plain], [r.at_trigger for r in plain]
    values = sorted({u for t, p in zip(traces, points, strict=True) for u, at in zip(t, p, strict=True) if at})
    if not values:
        raise ValueError("calibration decoded no visible tokens at a trigger point")
    values = [values[0] - 1e-3, *values]  # below every u (also when printed to 4 places): fire at every point
    gap, stop_gap = config.tau_high - config.tau_low, config.tau_high - config.tau_stop
    candidates = [values[round(q * (len(values) - 1) / 200)] for q in range(201)]

    def rate(t: float) -> float:
        return _replay_gate(traces, points, t, t - gap, config.cooldown)

    best = min(candidates, key=lambda t: abs(rate(t) - target))
    tuned = dataclasses.replace(config, tau_high=best, tau_low=best - gap, tau_stop=best - stop_gap, ablation="gate")
    measured = decode(tuned)
    visible = sum(len(r.token_ids) for r in measured)
    return Calibration(
        tau_high=best,
        tau_low=tuned.tau_low,
        tau_stop=tuned.tau_stop,
        target_rate=target,
        simulated_rate=rate(best),
        measured_rate=sum(r.n_reflections for r in measured) / max(1, visible),
        visible_tokens=visible,
    )


# --- the stop rule ----------------------------------------------------------------------------------------------


@dataclass
class StopTrial:
    """What one stop rule measured on the calibration problems."""

    stop: StopRule
    accuracy: float
    n: int
    reflections: int
    hidden_tokens: int
    peek_tokens: int
    fpe: int
    end_reasons: dict[str, int]  # reflections per end reason


@dataclass
class StopChoice:
    stop: StopRule
    trials: list[StopTrial]


def choose_stop(
    decode_and_grade: Callable[[ReflectiveConfig], tuple[list[ReflectiveResult], list[bool]]],
    config: ReflectiveConfig,
    candidates: Sequence[StopRule] = STOP_RULES,
) -> StopChoice:
    """The stop rule with the highest accuracy on dev problems (ties: the lower FPE, then the earlier candidate).

    `decode_and_grade(config)` decodes the same dev problems with `config` (the gated run, `ablation="gate"`) and
    returns the results and whether each is correct. Pass only candidates the tokenizer can run (`end_marker`
    needs single-id markers). Every trial is returned, so the caller can log what was measured.
    """
    if not candidates:
        raise ValueError("choose_stop needs at least one candidate stop rule")
    trials = []
    for stop in candidates:
        results, correct = decode_and_grade(dataclasses.replace(config, stop=stop, ablation="gate"))
        if len(results) != len(correct) or not results:
            raise ValueError(f"stop={stop}: got {len(results)} results and {len(correct)} grades")
        trials.append(StopTrial(
            stop=stop,
            accuracy=sum(correct) / len(correct),
            n=len(correct),
            reflections=sum(r.n_reflections for r in results),
            hidden_tokens=sum(r.hidden_tokens for r in results),
            peek_tokens=sum(r.peek_tokens for r in results),
            fpe=sum(r.usage.fpe for r in results),
            end_reasons=dict(Counter(reason for r in results for reason in r.end_reasons)),
        ))
    best = max(trials, key=lambda t: (t.accuracy, -t.fpe))  # max keeps the first of equals
    return StopChoice(best.stop, trials)


# --- ablations --------------------------------------------------------------------------------------------------


def matched_ablations(
    config: ReflectiveConfig, visible: int, reflections: int, hidden: int, trigger_points: int | None = None
) -> dict[str, ReflectiveConfig]:
    """Configs of the three ablations matched to a gated run's hidden budget.

    The gated run is summed up by its visible tokens, reflections, hidden tokens and, with `trigger_after`, the
    visible steps that were trigger points (eval keeps those per record; `None` counts every visible step).

    All three keep the gated run's `trigger_after`, B_total and L_reflect, so only the gating signal differs and
    hidden tokens per example stay comparable; report H beside each row.
    - periodic and random keep the gated run's `stop` rule and trigger as often as the gate did. random fires with
      probability reflections / trigger points at each trigger point. periodic fires at the first trigger point
      once `period` visible tokens have passed, so its period sits half the mean spacing s of trigger points
      below the gate's mean gap g (with points every s tokens, any period in (g - s, g] lands on g).
    - fixed keeps the gate but reflects for the gated run's mean reflection length with no stop at all: neither
      a peek nor the model's own R_END ends it (R_END is banned in its hidden tokens), whatever `stop` says. It
      isolates the stop rule: against `end_marker` it asks whether the model's choice of where to end matters.
    """
    points = visible if trigger_points is None else trigger_points
    gap = visible / reflections if reflections else math.inf
    spacing = visible / max(1, points)
    period = max(1, math.floor(gap - spacing / 2) + 1) if reflections else 10**9  # spacing 1: gap, rounded
    mean_length = max(1, round(hidden / reflections)) if reflections else config.reflect_length
    return {
        "reflective-periodic": dataclasses.replace(config, ablation="periodic", period=period),
        "reflective-random": dataclasses.replace(
            config, ablation="random", random_rate=min(1.0, reflections / max(1, points))
        ),
        "reflective-fixed": dataclasses.replace(config, ablation="fixed", reflect_length=mean_length),
    }
