"""The decode loop of Reflective Decoding (what it does and why: reflective.py), phase by phase: each step the
visible rows pass the gate and emit a token or R_START, the hidden rows draw a hidden token with its peek, one forward
feeds them all, the peeks are settled and finished rows leave the batch. Also the result it returns per prompt."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from redumix.generate.accounting import Usage
from redumix.generate.loop import should_compact
from redumix.generate.policy import SamplingPolicy, policy_logprobs, sample_tokens, uniform_noise
from redumix.generate.reflective_config import ReflectiveConfig
from redumix.generate.reflective_markers import Markers, ban, completing_ids, resolve_markers
from redumix.generate.reflective_rules import at_trigger_point, peek_agrees, uncertainty
from redumix.generate.reflective_step import settle_peeks, step_with_peek
from redumix.generate.state import DecodeState, prefill, select


@dataclass
class ReflectiveResult:
    token_ids: list[int]  # visible ids, including the stop token when the row stopped on one
    text: str  # visible text without the stop token; never holds a marker
    finished: bool
    usage: Usage
    n_reflections: int = 0
    hidden_tokens: int = 0
    peek_tokens: int = 0  # R_END positions fed as peeks (FPE only)
    marker_tokens: int = 0  # R_START and adopted or fixed R_END positions (FPE only)
    reflection_lengths: list[int] = field(default_factory=list)
    # Per reflection: model_end (it wrote R_END), peek (the stop rule; also when it fired at the limit), length
    # (reflect_length) or budget (budget_total).
    end_reasons: list[str] = field(default_factory=list)
    reflection_positions: list[int] = field(default_factory=list)  # visible tokens emitted before each reflection
    uncertainty: list[float] = field(default_factory=list)  # the gate's u at every visible step
    at_trigger: list[bool] = field(default_factory=list)  # per visible step: the text so far ended at a trigger point
    delta_uncertainty: list[float] = field(default_factory=list)  # u after − u before, per reflection
    delta_nll: list[float] = field(default_factory=list)  # NLL after − before of the next visible token
    audit_ids: list[int] = field(default_factory=list)  # audit only: everything after the prompt, markers included
    audit_text: str = ""


# --- a row's state machine, and what a batch fixes before it starts --------------------------------------------------


@dataclass
class _Row:
    """One example's state machine."""

    index: int
    seed: int
    hidden_mode: bool = False
    armed: bool = True
    cooldown: int = 0
    since_reflection: int = 0  # visible tokens since the last reflection (or the start)
    visible: list[int] = field(default_factory=list)
    current: list[int] = field(default_factory=list)  # hidden tokens of the reflection in progress
    hidden_used: int = 0
    hidden_draws: int = 0  # hidden samples drawn, R_END included: the step of the hidden noise stream
    finished: bool = False
    done: bool = False
    u_before: float = 0.0
    logprobs_before: torch.Tensor | None = None  # model log-probs [V] at the trigger, for Δ-NLL
    fed_visible: int = 0
    peek_tokens: int = 0
    marker_tokens: int = 0
    trace: list[int] = field(default_factory=list)
    result: ReflectiveResult = field(default_factory=lambda: ReflectiveResult([], "", False, Usage()))


def _stream(seeds: torch.Tensor, salt: int) -> torch.Tensor:
    # Hidden sampling and random triggers draw from their own noise streams, so that visible sampling stays
    # exactly that of plain decoding until the first reflection.
    return (seeds.long() * 0x9E3779B1 + salt) & ((1 << 31) - 1)


def _should_trigger(row: _Row, u: float, trigger_noise: float, point: bool, config: ReflectiveConfig) -> bool:
    """The gate (or the ablation's signal), at a trigger point, with no cooldown and hidden budget left."""
    if not point or row.hidden_used >= config.budget_total or row.cooldown > 0:
        return False
    if config.ablation == "periodic":
        return row.since_reflection >= config.period
    if config.ablation == "random":
        return trigger_noise < config.random_rate
    return row.armed and u > config.tau_high


@dataclass
class _Plan:
    """What a batch fixes before its first step: the markers, the stop rule, the banlists and the two policies."""

    config: ReflectiveConfig
    policy: SamplingPolicy  # the visible tokens'
    reflect_policy: SamplingPolicy  # the hidden tokens'
    markers: Markers
    stop_rule: str  # config.stop, or "none" (the fixed ablation: no stop of any kind)
    model_may_end: bool  # a sampled single-id R_END ends the reflection
    visible_banned: list[list[int]]
    hidden_banned: list[list[int]]
    closing: list[list[int]]  # peek_agree: what may follow a finished check
    check_result: re.Pattern[str]
    stop: set[int]
    max_new_tokens: int

    @property
    def peeks(self) -> bool:
        return self.stop_rule in ("peek", "peek_agree")


def _plan(
    tokenizer: PreTrainedTokenizerBase,
    policy: SamplingPolicy,
    stop_ids: Sequence[int],
    config: ReflectiveConfig,
    max_new_tokens: int,
) -> _Plan:
    markers = resolve_markers(tokenizer, config)
    stop_rule = "none" if config.ablation == "fixed" else config.stop
    if stop_rule == "end_marker" and not markers.single_ids:
        raise ValueError(
            f"reflective.stop='end_marker' needs single-id markers, but {tokenizer.name_or_path} has "
            f"{markers.source} markers of {len(markers.start)}/{len(markers.end)} ids, which a model cannot write as "
            "one token: use reflective.stop=peek or reflective.stop=peek_agree, or a tokenizer with single-id markers"
        )
    only_reflection = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in config.reflection_only_tokens]
    model_may_end = config.model_may_end and markers.single_ids and stop_rule != "none"
    stops = [[s] for s in stop_ids if s >= 0]
    return _Plan(
        config=config,
        policy=policy,
        reflect_policy=SamplingPolicy(
            temperature=config.reflect_temperature, top_p=config.reflect_top_p, max_new_tokens=max_new_tokens
        ),
        markers=markers,
        stop_rule=stop_rule,
        model_may_end=model_may_end,
        visible_banned=[markers.start, markers.end, *only_reflection],
        hidden_banned=[markers.start, *([] if model_may_end else [markers.end]), *stops],
        closing=[markers.start, *stops],
        check_result=re.compile(config.check_result),
        stop=set(stop_ids),
        max_new_tokens=max_new_tokens,
    )


@dataclass
class _Step:
    """What one step feeds each active row, and which reflections it ends."""

    main: list[list[int]]  # a visible token, R_START, a hidden token or the model's own R_END; [] feeds nothing
    peek: list[list[int]]  # R_END on top of a hidden token, or []
    ends: list[bool]  # the peek appended this step, if any, ends the reflection
    reasons: list[str]  # why, when it does

    @classmethod
    def empty(cls, rows: int) -> _Step:
        return cls([[] for _ in range(rows)], [[] for _ in range(rows)], [False] * rows, [""] * rows)


# --- the decode loop -------------------------------------------------------------------------------------------------


@torch.inference_mode()
def reflective_generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    policy: SamplingPolicy,
    seeds: Sequence[int],
    stop_ids: Sequence[int],
    pad_id: int,
    config: ReflectiveConfig,
    max_new_tokens: int | None = None,
) -> list[ReflectiveResult]:
    """Reflective decoding of a batch of prompts: one `ReflectiveResult` per prompt, in order."""
    plan = _plan(tokenizer, policy, stop_ids, config, max_new_tokens or policy.max_new_tokens)
    state = prefill(model, prompts, pad_id)
    rows = [_Row(i, int(s)) for i, s in enumerate(seeds)]
    active = list(rows)  # row i of `state` is active[i]
    while active:
        seeds_t = torch.as_tensor([r.seed for r in active], device=state.attention_mask.device)
        step = _Step.empty(len(active))
        _visible_step(tokenizer, state, active, seeds_t, step, plan)
        _hidden_step(state, active, seeds_t, step, plan)
        if not any(step.main):
            break
        if config.audit:
            for row, segment in zip(active, step.main, strict=True):
                row.trace += segment
        state, main_logits, peek_logits = step_with_peek(model, state, step.main, step.peek, pad_id, config.dual_path)
        state = _settle_step(tokenizer, state, active, step, main_logits, peek_logits, plan)
        _end_reflections(active, step, config)
        keep_rows = [i for i, r in enumerate(active) if not r.done]
        if not keep_rows:
            break
        if should_compact(len(active) - len(keep_rows), len(active)):
            state = select(state, keep_rows)
            active = [active[i] for i in keep_rows]
    return [_finish(row, tokenizer, prompts[row.index], plan.stop, config) for row in rows]


# --- visible rows: the gate, then R_START or a visible token


def _visible_step(
    tokenizer: PreTrainedTokenizerBase,
    state: DecodeState,
    active: list[_Row],
    seeds: torch.Tensor,
    step: _Step,
    plan: _Plan,
) -> None:
    vis = [i for i, r in enumerate(active) if not r.hidden_mode and not r.done]
    if not vis:
        return
    config, policy = plan.config, plan.policy
    raw = ban(state.last_logits[vis], [completing_ids(active[i].visible, plan.visible_banned) for i in vis])
    logprobs = policy_logprobs(raw, policy)
    u = uncertainty(logprobs, config.gate, config.gate_top_k).tolist()
    steps = torch.as_tensor([len(active[i].visible) for i in vis], device=raw.device)
    tokens = sample_tokens(logprobs, policy, seeds[vis], steps).tolist()
    trigger_noise = uniform_noise(_stream(seeds[vis], 0x2545F491), steps, 1)[:, 0].tolist()
    model_lp = torch.log_softmax(raw, dim=-1)
    for j, i in enumerate(vis):
        row = active[i]
        point = at_trigger_point(tokenizer, row.visible, config.trigger_after)
        if _should_trigger(row, u[j], trigger_noise[j], point, config):
            step.main[i] = _start_reflection(row, u[j], model_lp[j], plan.markers)
        else:
            step.main[i] = _emit_visible(row, tokens[j], u[j], model_lp[j], point, plan)


def _start_reflection(row: _Row, u: float, model_lp: torch.Tensor, markers: Markers) -> list[int]:
    """The row turns hidden; R_START is what it feeds."""
    row.hidden_mode, row.armed, row.current = True, False, []
    row.u_before, row.logprobs_before = u, model_lp
    row.result.reflection_positions.append(len(row.visible))
    row.marker_tokens += len(markers.start)
    return list(markers.start)


def _emit_visible(row: _Row, token: int, u: float, model_lp: torch.Tensor, point: bool, plan: _Plan) -> list[int]:
    """The row emits `token`; it feeds it unless a stop token or the length cap finishes the row."""
    if row.logprobs_before is not None:  # first visible token after a reflection
        row.result.delta_uncertainty.append(u - row.u_before)
        row.result.delta_nll.append(float(row.logprobs_before[token] - model_lp[token]))
        row.logprobs_before = None
    row.visible.append(token)
    row.result.uncertainty.append(u)
    row.result.at_trigger.append(point)
    row.since_reflection += 1
    row.cooldown = max(0, row.cooldown - 1)
    if u < plan.config.tau_low:
        row.armed = True
    if token in plan.stop or len(row.visible) >= plan.max_new_tokens:
        row.done, row.finished = True, token in plan.stop
        return []
    row.fed_visible += 1
    return [token]


# --- hidden rows: a hidden token, and R_END on top of it as a peek or as the end


def _hidden_step(state: DecodeState, active: list[_Row], seeds: torch.Tensor, step: _Step, plan: _Plan) -> None:
    hid = [i for i, r in enumerate(active) if r.hidden_mode and not step.main[i]]  # not those that just began
    if not hid:
        return
    raw = ban(state.last_logits[hid], [completing_ids(active[i].current, plan.hidden_banned) for i in hid])
    steps = torch.as_tensor([active[i].hidden_draws for i in hid], device=raw.device)
    hidden_seeds = _stream(seeds[hid], 0x68E31DA4)
    policy = plan.reflect_policy
    tokens = sample_tokens(policy_logprobs(raw, policy), policy, hidden_seeds, steps).tolist()
    for j, i in enumerate(hid):
        _hidden_token(active[i], tokens[j], i, step, plan)


def _hidden_token(row: _Row, token: int, i: int, step: _Step, plan: _Plan) -> None:
    """Row `i` of the step drew `token`: the model's own R_END ends the reflection, a limit puts R_END after the
    token, and a peek rule peeks after it."""
    end, config = plan.markers.end, plan.config
    row.hidden_draws += 1
    if plan.model_may_end and token == end[0]:
        step.main[i], step.ends[i], step.reasons[i] = [token], True, "model_end"
        row.marker_tokens += len(end)
        return
    row.current.append(token)
    row.hidden_used += 1
    step.main[i] = [token]
    if len(row.current) >= config.reflect_length:
        step.reasons[i] = "length"
    elif row.hidden_used >= config.budget_total:
        step.reasons[i] = "budget"
    if plan.peeks or step.reasons[i]:
        step.peek[i] = list(end)
        step.ends[i] = bool(step.reasons[i])
        if plan.peeks:
            row.peek_tokens += len(end)
        else:
            row.marker_tokens += len(end)


# --- after the forward: stop rows adopt their peek, the others crop it back off


def _settle_step(
    tokenizer: PreTrainedTokenizerBase,
    state: DecodeState,
    active: list[_Row],
    step: _Step,
    main_logits: torch.Tensor,
    peek_logits: torch.Tensor | None,
    plan: _Plan,
) -> DecodeState:
    """The state after the step's peeks are settled, with each row's next logits: after its peek where it adopted
    one, after its main segment where it fed one, else as they were."""
    fed = torch.as_tensor([bool(s) for s in step.main], device=main_logits.device)
    last = torch.where(fed[:, None], main_logits, state.last_logits)
    if peek_logits is not None:
        peeked = [bool(p) for p in step.peek]
        if plan.peeks:
            _peek_stops(tokenizer, active, step, peeked, main_logits, peek_logits, plan)
        keep = torch.as_tensor([p and e for p, e in zip(peeked, step.ends, strict=True)], device=last.device)
        last = torch.where(keep[:, None], peek_logits, last)
        state = settle_peeks(state, torch.as_tensor(peeked, device=last.device), keep, len(plan.markers.end))
    return DecodeState(state.cache, state.attention_mask, state.lengths, last)


def _peek_stops(
    tokenizer: PreTrainedTokenizerBase,
    active: list[_Row],
    step: _Step,
    peeked: list[bool],
    main_logits: torch.Tensor,
    peek_logits: torch.Tensor,
    plan: _Plan,
) -> None:
    """The stop rule on each peek: a confident one (u <= tau_stop) ends the reflection, and under peek_agree only
    if it also agrees with the check the span just finished."""
    config = plan.config
    idx = [i for i, p in enumerate(peeked) if p]
    raw = ban(peek_logits[idx], [completing_ids(active[i].visible, plan.visible_banned) for i in idx])
    u_peek = uncertainty(policy_logprobs(raw, plan.policy), config.gate, config.gate_top_k).tolist()
    for j, i in enumerate(idx):
        if u_peek[j] > config.tau_stop:
            continue
        if plan.stop_rule == "peek_agree":
            following = ban(main_logits[i : i + 1], [completing_ids(active[i].current, plan.closing)])
            span = active[i].current
            if not peek_agrees(tokenizer, span, raw[j], following[0], plan.check_result, plan.markers.end[0]):
                continue
        step.ends[i], step.reasons[i] = True, "peek"


def _end_reflections(active: list[_Row], step: _Step, config: ReflectiveConfig) -> None:
    for i, row in enumerate(active):
        if step.ends[i]:
            if config.audit and step.peek[i]:
                row.trace += step.peek[i]
            row.result.reflection_lengths.append(len(row.current))
            row.result.end_reasons.append(step.reasons[i])
            row.hidden_mode, row.cooldown, row.since_reflection = False, config.cooldown, 0


def _finish(
    row: _Row,
    tokenizer: PreTrainedTokenizerBase,
    prompt: list[int],
    stop: set[int],
    config: ReflectiveConfig,
) -> ReflectiveResult:
    res = row.result
    res.token_ids, res.finished = row.visible, row.finished
    content = row.visible[:-1] if row.finished and row.visible and row.visible[-1] in stop else row.visible
    res.text = tokenizer.decode(content, skip_special_tokens=True)
    res.n_reflections = len(res.reflection_positions)
    res.hidden_tokens = row.hidden_used
    res.peek_tokens, res.marker_tokens = row.peek_tokens, row.marker_tokens
    if config.audit:
        res.audit_ids = row.trace
        res.audit_text = tokenizer.decode(row.trace, skip_special_tokens=False)
    res.usage = Usage(
        visible_tokens=len(row.visible),
        generated_tokens=len(row.visible) + row.hidden_used,
        prefill_tokens=len(prompt),
        fpe=len(prompt) + row.fed_visible + row.hidden_used + row.peek_tokens + row.marker_tokens,
    )
    return res
