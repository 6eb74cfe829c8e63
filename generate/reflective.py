"""Hidden-KV Reflective Decoding (the reflective-decoding seed paper, sections 3.2-3.9).

When the next visible token is uncertain, the row pauses its visible output, appends R_START to its KV cache,
decodes hidden tokens under a reflection policy, and appends R_END; then visible decoding resumes from a cache
that holds the reflection. The user never sees the hidden tokens or the markers.

Features and the settings that switch them (`ReflectiveConfig`):
- The gate (seed 3.2): `gate`, `tau_high`/`tau_low` (hysteresis), `cooldown`; `ablation` swaps the gating signal
  for a periodic or random trigger, or keeps the gate with fixed-length reflections and no stop.
- Trigger points: `trigger_after` (e.g. `[" = "]`) lets a reflection start only where the visible text so far ends
  with one of the strings, the way Speculative Thinking hands off to the large model only after "\\n\\n". It applies
  to the gate and to the periodic/random ablations alike, so only the gating signal differs between a gated run and
  its ablations. A periodic ablation triggers at the first trigger point once `period` visible tokens have passed.
- How a reflection ends, `stop` (besides `reflect_length` and `budget_total`, which always end it):
  `end_marker` (default): only the model's own R_END ends it (single-id markers); no peek is ever fed.
  `peek`: the seed's rule (3.4), a peek with u <= `tau_stop` after R_END, or the model's own R_END.
  `peek_agree`: a confident peek that also agrees with the check the span just finished (see `peek_agrees`), or
  the model's own R_END. `ReflectiveResult.end_reasons` records why each reflection ended.
- Hidden tokens are greedy by default (`reflect_temperature` 0).

What was measured on the embedded arithmetic model, which was trained with hidden check spans
(`54 * 3 = <|reflect|>50 * 3 = 150, 4 * 3 = 12, 150 + 12 = 162<|/reflect|>162` after ` = ` on terse lines), and
why the defaults are what they are:
- The copy trap: a peek stop rewards spans whose end a model can copy. After a one-digit junk span, the visible
  token after R_END copies the span's last number, so the peek's u is near zero: 854 of 860 spans ended on the peek,
  749 after one hidden token. Ungated, spans also opened where training never put them (702 of 860 inside a
  number): hence `trigger_after`. Sampled hidden tokens (temperature 1) cost ~9 points against greedy ones, and
  reflect_length 24 cut the median training span of 25 tokens: hence greedy, 48 (and budget_total 128).
- 300 test problems, greedy visible tokens, the recipe's gate: plain decoding 61.0%; spans only after ` = ` ended
  by `end_marker` 68.0% (FPE 54 per problem), by `peek_agree` 68.0% (FPE 67), by `peek` 34.7%; `end_marker` with
  spans anywhere 44.3%. `peek_agree` ends almost every span where the model's own R_END would (its peek agrees with
  the finished check), so on a model trained with the markers it only adds the peeks' cost.

How it differs from the seed's pseudocode, and why:
- Batched: every example is a row of one `DecodeState` with its own state machine (visible or hidden mode,
  armed/cooldown, budgets). Each step feeds one segment per row: a visible token, R_START, or a hidden token.
- The peek is a *crop-back branch*, not a cache copy: the hidden token h and R_END go through the model in one
  forward pass ("dual-path batching", seed 3.4): the logits at h's position are the next hidden distribution, the
  logits after R_END are the peek. Causal attention means h's logits cannot see R_END. If the row goes on
  reflecting, R_END is cropped back off (physically when no row keeps its peek, else masked out as a hole).
  `dual_path=False` runs the same thing as two forward passes (the sequential baseline `make bench` compares).
- When the peek says stop, its R_END *is* the main path's R_END: the branch is adopted, not recomputed. The seed's
  formula FPE = V + H(1+m_e) + N_ref(m_s+m_e) charges that append twice. Here, with N_model the reflections the
  model ended itself (it wrote R_END, m_e = 1):
    peek, peek_agree: FPE = prefill + V_fed + H(1+m_e) + N_ref·m_s + N_model·m_e
    end_marker, fixed: FPE = prefill + V_fed + H + N_ref(m_s+m_e)  (no peeks are fed)
  Each part is in the result (`hidden_tokens`, `peek_tokens`, `marker_tokens`), and the sum equals
  `ForwardCounter`'s count.
- Δ-NLL is measured on the first visible token emitted after a reflection, under the model's own distribution
  (temperature 1, banlist applied, no truncation, so it stays finite): NLL after minus NLL before. Δ-uncertainty is
  the gate's u after minus before. Negative means the reflection made the model surer.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from redumix.data.task import Example, Task
from redumix.generate.accounting import Usage
from redumix.generate.decoder import Decoded, Model, Tokenizer, attempt_prompts, example_seeds
from redumix.generate.loop import should_compact
from redumix.generate.model_io import stop_token_ids
from redumix.generate.policy import SamplingPolicy, policy_logprobs, sample_tokens, uniform_noise
from redumix.generate.state import DecodeState, left_pad, prefill, select

GateKind = Literal["norm_entropy", "entropy", "one_minus_pmax", "margin", "topk_entropy"]
Ablation = Literal["gate", "periodic", "random", "fixed"]
StopRule = Literal["end_marker", "peek", "peek_agree"]
STOP_RULES: tuple[StopRule, ...] = ("end_marker", "peek", "peek_agree")


@dataclass
class ReflectiveConfig:
    gate: GateKind = field(
        default="norm_entropy",
        metadata={
            "help": "Uncertainty u of the visible policy: entropy normalised by log|S| (in [0,1]), raw "
            "entropy (nats), 1-p_max, margin (p_2/p_1, 1 = tie) or entropy of the top gate_top_k."
        },
    )
    gate_top_k: int = field(default=10, metadata={"help": "k of the topk_entropy gate."})
    tau_high: float = field(default=0.65, metadata={"help": "Trigger when uncertainty exceeds this."})
    tau_low: float = field(default=0.45, metadata={"help": "Re-arm the gate once uncertainty falls below this."})
    tau_stop: float = field(
        default=0.45, metadata={"help": "End a reflection once the peek's uncertainty after R_END is at most this."}
    )
    reflect_temperature: float = field(
        default=0.0, metadata={"help": "Temperature of the hidden reflection policy (0 = greedy)."}
    )
    reflect_top_p: float = field(default=0.95, metadata={"help": "Top-p of the hidden reflection policy."})
    reflect_length: int = field(default=48, metadata={"help": "L_reflect: most hidden tokens in one reflection."})
    budget_total: int = field(default=128, metadata={"help": "B_total: most hidden tokens per example."})
    cooldown: int = field(default=4, metadata={"help": "Visible tokens after a reflection before another may start."})
    ablation: Ablation = field(
        default="gate",
        metadata={
            "help": "gate: uncertainty-gated, ended by `stop`; periodic: every `period` visible tokens; random: "
            "with probability random_rate per visible step; both at trigger points only and ended by `stop`; "
            "fixed: gated, no stop of any kind (always reflect_length hidden tokens)."
        },
    )
    stop: StopRule = field(
        default="end_marker",
        metadata={
            "help": "What ends a reflection before reflect_length/budget_total. end_marker: only the model's own "
            "R_END (needs single-id markers; no peeks are fed). peek: the seed's peek, u after R_END <= tau_stop, "
            "or the model's R_END. peek_agree: a confident peek that begins the result of the check the span just "
            "finished (check_result), or the model's R_END."
        },
    )
    check_result: str = field(
        default=r"=\s*(\d+)\s*$",
        metadata={
            "help": "peek_agree: regex searched in the decoded hidden span; it must match at a finished check and "
            "its one group is the check's result."
        },
    )
    trigger_after: list[str] = field(
        default_factory=list,
        metadata={
            "help": "A reflection may start only where the visible text so far ends with one of these strings "
            "(e.g. [' = ']); [] = anywhere. Holds for the gate and the periodic/random ablations alike."
        },
    )
    period: int = field(
        default=16,
        metadata={"help": "periodic ablation: visible tokens between reflections (then the next trigger point)."},
    )
    random_rate: float = field(
        default=0.1, metadata={"help": "random ablation: trigger probability per visible step at a trigger point."}
    )
    dual_path: bool = field(
        default=True, metadata={"help": "Run each hidden step and its peek in one forward pass (else two)."}
    )
    model_may_end: bool = field(
        default=True,
        metadata={"help": "A sampled single-id R_END ends the reflection (models trained on check spans)."},
    )
    marker_start: str = field(default="<|reflect|>", metadata={"help": "R_START if the tokenizer has it as one id."})
    marker_end: str = field(default="<|/reflect|>", metadata={"help": "R_END if the tokenizer has it as one id."})
    reflection_only_tokens: list[str] = field(
        default_factory=list, metadata={"help": "Tokens allowed inside reflections only (banned when visible)."}
    )
    audit: bool = field(
        default=False, metadata={"help": "Keep hidden tokens and markers in the results (never on by default)."}
    )
    calibrate_rate: float = field(
        default=0.1, metadata={"help": "`redumix calibrate`: target reflections per visible token."}
    )

    def __post_init__(self) -> None:
        problems = []
        if self.tau_low > self.tau_high:
            problems.append(f"tau_low ({self.tau_low}) must be <= tau_high ({self.tau_high})")
        if self.gate_top_k < 2:
            problems.append(f"gate_top_k must be >= 2, got {self.gate_top_k}")
        if self.reflect_temperature < 0:
            problems.append(f"reflect_temperature must be >= 0, got {self.reflect_temperature}")
        if not 0 < self.reflect_top_p <= 1:
            problems.append(f"reflect_top_p must be in (0, 1], got {self.reflect_top_p}")
        if self.reflect_length < 1:
            problems.append(f"reflect_length must be >= 1, got {self.reflect_length}")
        if self.budget_total < 0:
            problems.append(f"budget_total must be >= 0, got {self.budget_total}")
        if self.cooldown < 0:
            problems.append(f"cooldown must be >= 0, got {self.cooldown}")
        if self.period < 1:
            problems.append(f"period must be >= 1, got {self.period}")
        if not 0 <= self.random_rate <= 1:
            problems.append(f"random_rate must be in [0, 1], got {self.random_rate}")
        if not 0 < self.calibrate_rate < 1:
            problems.append(f"calibrate_rate must be in (0, 1), got {self.calibrate_rate}")
        if self.stop not in STOP_RULES:
            problems.append(f"stop must be one of {', '.join(STOP_RULES)}, got {self.stop!r}")
        if self.stop == "end_marker" and not self.model_may_end and self.ablation != "fixed":
            problems.append("stop='end_marker' needs model_may_end=True (the model's R_END is its only stop); "
                            "for fixed-length reflections use ablation='fixed'")
        try:
            groups = re.compile(self.check_result).groups
        except re.error as exc:
            problems.append(f"check_result {self.check_result!r} is not a valid regex ({exc})")
        else:
            if groups != 1:
                problems.append(f"check_result must have exactly one group (the result), got {groups}")
        if any(not isinstance(s, str) or not s for s in self.trigger_after):
            problems.append(f"trigger_after must hold non-empty strings, got {self.trigger_after!r}")
        if problems:
            raise ValueError("; ".join(problems))


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


# --- markers and banlists -------------------------------------------------------------------------------------------


@dataclass
class Markers:
    start: list[int]
    end: list[int]
    source: Literal["named", "reserved", "sequence"]

    @property
    def single_ids(self) -> bool:
        return len(self.start) == 1 and len(self.end) == 1


_FALLBACK_MARKERS = [(" ⟦reflect⟧", " ⟦/reflect⟧"), (" <<<reflect>>>", " <<</reflect>>>"), (" @@r@@", " @@/r@@")]
_STABILITY_CONTEXTS = [("", ""), ("x", "y"), ("= ", " 12"), ("\n", "\n"), ("The answer", "."), ("42", "7")]


def _single_id(tokenizer: PreTrainedTokenizerBase, text: str) -> int | None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 and ids[0] != tokenizer.unk_token_id else None


def _is_stable(tokenizer: PreTrainedTokenizerBase, text: str) -> bool:
    """The marker's ids appear unchanged whatever surrounds it (BPE merges never reach across it)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids or tokenizer.unk_token_id in ids:
        return False
    for before, after in _STABILITY_CONTEXTS:
        full = tokenizer(before + text + after, add_special_tokens=False)["input_ids"]
        if not any(full[i : i + len(ids)] == ids for i in range(len(full) - len(ids) + 1)):
            return False
    return True


def resolve_markers(tokenizer: PreTrainedTokenizerBase, config: ReflectiveConfig) -> Markers:
    """R_START/R_END: the named single-id tokens, else two reserved/unused special tokens, else a stable sequence."""
    start, end = _single_id(tokenizer, config.marker_start), _single_id(tokenizer, config.marker_end)
    if start is not None and end is not None:
        return Markers([start], [end], "named")
    template = getattr(tokenizer, "chat_template", None) or ""
    vocab = tokenizer.get_vocab()
    reserved = sorted(
        (i, t)
        for t, i in vocab.items()
        if ("reserved" in t.lower() or "unused" in t.lower()) and t not in template and _single_id(tokenizer, t) == i
    )
    if len(reserved) >= 2:
        return Markers([reserved[0][0]], [reserved[1][0]], "reserved")
    for start_text, end_text in _FALLBACK_MARKERS:
        if _is_stable(tokenizer, start_text) and _is_stable(tokenizer, end_text):
            start_ids = tokenizer(start_text, add_special_tokens=False)["input_ids"]
            end_ids = tokenizer(end_text, add_special_tokens=False)["input_ids"]
            if start_ids != end_ids[: len(start_ids)]:
                return Markers(start_ids, end_ids, "sequence")
    raise ValueError(f"{tokenizer.name_or_path}: found no usable reflection markers (no single-id or stable sequence)")


def _completing_ids(tail: Sequence[int], sequences: Sequence[Sequence[int]]) -> list[int]:
    """Ids that would complete one of `sequences` after `tail` (a single-id sequence is always banned)."""
    banned = []
    for seq in sequences:
        prefix = list(seq[:-1])
        if not prefix or list(tail[len(tail) - len(prefix) :]) == prefix:
            banned.append(seq[-1])
    return banned


def _ban(logits: torch.Tensor, banned_per_row: list[list[int]]) -> torch.Tensor:
    rows = [r for r, ids in enumerate(banned_per_row) for _ in ids]
    cols = [i for ids in banned_per_row for i in ids]
    if not cols:
        return logits
    logits = logits.clone()
    logits[rows, cols] = float("-inf")
    return logits


# --- the uncertainty gate -------------------------------------------------------------------------------------------


def uncertainty(logprobs: torch.Tensor, kind: GateKind = "norm_entropy", top_k: int = 10) -> torch.Tensor:
    """u per row from the log-probs of the distribution the policy samples from (−inf outside its support S)."""
    support = torch.isfinite(logprobs)
    probs = logprobs.exp()
    plogp = torch.where(support, probs * logprobs, torch.zeros_like(probs))
    size = support.sum(dim=-1)
    if kind == "entropy":
        return -plogp.sum(dim=-1)
    if kind == "norm_entropy":
        log_size = size.clamp(min=2).float().log()
        return torch.where(size > 1, -plogp.sum(dim=-1) / log_size, torch.zeros_like(log_size))
    top = torch.topk(logprobs, min(max(top_k, 2), logprobs.shape[-1]), dim=-1).values
    if kind == "one_minus_pmax":
        return 1 - top[:, 0].exp()
    if kind == "margin":
        return torch.where(size > 1, (top[:, 1] - top[:, 0]).exp(), torch.zeros_like(top[:, 0]))
    if kind == "topk_entropy":
        kept = torch.log_softmax(top, dim=-1)
        finite = torch.isfinite(kept)
        ent = -torch.where(finite, kept.exp() * kept, torch.zeros_like(kept)).sum(dim=-1)
        return ent / math.log(top.shape[-1])
    raise ValueError(f"unknown gate {kind!r}")


# --- trigger points and the peek_agree stop -------------------------------------------------------------------------


def at_trigger_point(tokenizer: PreTrainedTokenizerBase, visible: Sequence[int], triggers: Sequence[str]) -> bool:
    """Whether the visible text so far ends with one of `triggers` (always, when there are none).

    Decodes only the last few tokens: at least one char per token is assumed, plus two spare tokens, so that a
    token cut at the window's start (a stripped leading space, a split UTF-8 byte) cannot change the tail. The
    window doubles while its text is still too short, so a string that spans token boundaries is still found.
    """
    if not triggers:
        return True
    longest = max(len(s) for s in triggers)
    n = longest + 2
    while True:
        text = tokenizer.decode(list(visible[-n:]), skip_special_tokens=True)
        if len(text) >= longest + 2 or n >= len(visible):
            return text.endswith(tuple(triggers))
        n *= 2


def peek_agrees(
    tokenizer: PreTrainedTokenizerBase,
    span: Sequence[int],
    peek_logits: torch.Tensor,
    next_logits: torch.Tensor,
    check_result: re.Pattern[str],
    end_id: int,
) -> bool:
    """peek_agree's test, beside the peek's confidence: does the peek begin the result of a check the span finished?

    Three things must hold, all read from logits the dual-path step already has (no extra forward pass):
    - the hidden span so far, decoded, matches `check_result` (searched; group 1 is the check's result, e.g.
      `162` in `... 150 + 12 = 162`);
    - the check is finished: the main path's most likely next hidden token (`next_logits`, the logits at the last
      hidden token's position, with R_START and stop ids banned but R_END allowed) closes the span or the line:
      it is R_END's first id `end_id`, another special token, or whitespace only. A digit would continue the
      number, and `,` or ` +` another step of the same check;
    - the peek's most likely visible token (argmax of `peek_logits`, banlist applied), decoded and stripped, is a
      non-empty prefix of the result (a tokenizer may split `162` into `16`, `2`).
    A one-digit junk span fails the first test and a half-written number or an intermediate step (`16 - 0 = 16,`)
    the second, so a peek that is sure only because it copies the span's last number (the copy trap) cannot end
    the span there. With only "not a digit" as the second test, the embedded model fell into the trap at
    intermediate steps (60 train problems, a span at every ` = `: 1.7% accuracy, against 47% with this test or
    with end_marker).
    """
    match = check_result.search(tokenizer.decode(list(span), skip_special_tokens=True))
    if match is None or not match.group(1):
        return False
    following = int(next_logits.argmax())
    closes = following == end_id or following in tokenizer.all_special_ids
    if not closes and tokenizer.decode([following], skip_special_tokens=True).strip():
        return False
    guess = tokenizer.decode([int(peek_logits.argmax())], skip_special_tokens=True).strip()
    return bool(guess) and match.group(1).startswith(guess)


# --- one step: the main segment and the peek, in one forward pass or two --------------------------------------------


def _run(
    model: PreTrainedModel, state: DecodeState, ids: torch.Tensor, mask: torch.Tensor, n_logits: int
) -> tuple[DecodeState, torch.Tensor]:
    """Like sampling.forward, but returns the logits of the last `n_logits` positions [B, n_logits, V]."""
    position_ids = (state.lengths[:, None] + mask.cumsum(dim=1) - 1).clamp(min=0)
    attention_mask = torch.cat([state.attention_mask, mask], dim=1)
    out = model(
        input_ids=ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=state.cache,
        use_cache=True,
        logits_to_keep=n_logits,
    )
    new = DecodeState(out.past_key_values, attention_mask, state.lengths + mask.sum(dim=1), state.last_logits)
    return new, out.logits.float()


@torch.inference_mode()
def step_with_peek(
    model: PreTrainedModel,
    state: DecodeState,
    main: Sequence[Sequence[int]],
    peek: Sequence[Sequence[int]],
    pad_id: int,
    dual_path: bool = True,
) -> tuple[DecodeState, torch.Tensor, torch.Tensor | None]:
    """Append each row's `main` segment, then its `peek` segment (R_END, or empty) on top of it.

    Returns the state with both appended (settle it with `settle_peeks`), the logits after each row's main
    segment [B, V] and, if any row peeked, the logits after its peek [B, V]. All peeks have the same length.
    """
    device = state.attention_mask.device
    main_ids, main_mask = left_pad(main, pad_id, device)
    width = max(len(p) for p in peek)
    if width == 0:
        state, logits = _run(model, state, main_ids, main_mask, 1)
        return state, logits[:, -1], None
    peek_ids = torch.full((len(peek), width), pad_id, dtype=torch.long, device=device)
    peek_mask = torch.zeros((len(peek), width), dtype=torch.long, device=device)
    for row, seq in enumerate(peek):
        if seq:
            peek_ids[row] = torch.as_tensor(seq, device=device)
            peek_mask[row] = 1
    if dual_path:
        ids, mask = torch.cat([main_ids, peek_ids], dim=1), torch.cat([main_mask, peek_mask], dim=1)
        state, logits = _run(model, state, ids, mask, width + 1)
        return state, logits[:, 0], logits[:, -1]
    state, main_logits = _run(model, state, main_ids, main_mask, 1)
    state, peek_logits = _run(model, state, peek_ids, peek_mask, 1)
    return state, main_logits[:, -1], peek_logits[:, -1]


def settle_peeks(state: DecodeState, peeked: torch.Tensor, keep: torch.Tensor, width: int) -> DecodeState:
    """Crop the last `width` positions (the peeks) back off every row except those in `keep`, which adopt theirs.

    When no row keeps its peek the columns are cut from the cache; otherwise they are masked out as holes.
    """
    drop = peeked & ~keep
    lengths = state.lengths - width * drop.long()
    if not keep.any():
        for layer in state.cache.layers:
            layer.crop(-width)
        return DecodeState(state.cache, state.attention_mask[:, :-width], lengths, state.last_logits)
    mask = state.attention_mask.clone()
    mask[drop, -width:] = 0
    return DecodeState(state.cache, mask, lengths, state.last_logits)


# --- the decoder ----------------------------------------------------------------------------------------------------


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
    max_new_tokens = max_new_tokens or policy.max_new_tokens
    markers = resolve_markers(tokenizer, config)
    m_s, m_e = len(markers.start), len(markers.end)
    stop_rule = "none" if config.ablation == "fixed" else config.stop
    if stop_rule == "end_marker" and not markers.single_ids:
        raise ValueError(
            f"reflective.stop='end_marker' needs single-id markers, but {tokenizer.name_or_path} has "
            f"{markers.source} markers of {m_s}/{m_e} ids, which a model cannot write as one token: use "
            "reflective.stop=peek or reflective.stop=peek_agree, or a tokenizer with single-id markers"
        )
    peeks = stop_rule in ("peek", "peek_agree")
    check_result = re.compile(config.check_result)
    reflect_policy = SamplingPolicy(
        temperature=config.reflect_temperature, top_p=config.reflect_top_p, max_new_tokens=max_new_tokens
    )
    only_reflection = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in config.reflection_only_tokens]
    visible_banned = [markers.start, markers.end, *only_reflection]
    model_may_end = config.model_may_end and markers.single_ids and stop_rule != "none"
    hidden_banned = [markers.start, *([] if model_may_end else [markers.end]), *[[s] for s in stop_ids if s >= 0]]
    closing = [markers.start, *[[s] for s in stop_ids if s >= 0]]  # peek_agree: what may follow a finished check
    stop = set(stop_ids)

    state = prefill(model, prompts, pad_id)
    rows = [_Row(i, int(s)) for i, s in enumerate(seeds)]
    active = list(rows)  # row i of `state` is active[i]
    while active:
        seeds_t = torch.as_tensor([r.seed for r in active], device=state.attention_mask.device)
        main: list[list[int]] = [[] for _ in active]
        peek: list[list[int]] = [[] for _ in active]
        ends: list[bool] = [False] * len(active)  # the peek appended this step, if any, ends the reflection
        reasons: list[str] = [""] * len(active)  # why, when it does

        # --- visible rows: gate, then either R_START or a visible token
        vis = [i for i, r in enumerate(active) if not r.hidden_mode and not r.done]
        if vis:
            raw = _ban(state.last_logits[vis], [_completing_ids(active[i].visible, visible_banned) for i in vis])
            logprobs = policy_logprobs(raw, policy)
            u = uncertainty(logprobs, config.gate, config.gate_top_k).tolist()
            steps = torch.as_tensor([len(active[i].visible) for i in vis], device=raw.device)
            tokens = sample_tokens(logprobs, policy, seeds_t[vis], steps).tolist()
            trigger_noise = uniform_noise(_stream(seeds_t[vis], 0x2545F491), steps, 1)[:, 0].tolist()
            model_lp = torch.log_softmax(raw, dim=-1)
            for j, i in enumerate(vis):
                row = active[i]
                point = at_trigger_point(tokenizer, row.visible, config.trigger_after)
                if _should_trigger(row, u[j], trigger_noise[j], point, config):
                    row.hidden_mode, row.armed, row.current = True, False, []
                    row.u_before, row.logprobs_before = u[j], model_lp[j]
                    row.result.reflection_positions.append(len(row.visible))
                    main[i] = list(markers.start)
                    row.marker_tokens += m_s
                    continue
                if row.logprobs_before is not None:  # first visible token after a reflection
                    row.result.delta_uncertainty.append(u[j] - row.u_before)
                    row.result.delta_nll.append(float(row.logprobs_before[tokens[j]] - model_lp[j, tokens[j]]))
                    row.logprobs_before = None
                row.visible.append(tokens[j])
                row.result.uncertainty.append(u[j])
                row.result.at_trigger.append(point)
                row.since_reflection += 1
                row.cooldown = max(0, row.cooldown - 1)
                if u[j] < config.tau_low:
                    row.armed = True
                if tokens[j] in stop or len(row.visible) >= max_new_tokens:
                    row.done, row.finished = True, tokens[j] in stop
                else:
                    main[i] = [tokens[j]]
                    row.fed_visible += 1

        # --- hidden rows: sample a hidden token, peek after it
        hid = [i for i, r in enumerate(active) if r.hidden_mode and not main[i]]
        if hid:
            raw = _ban(state.last_logits[hid], [_completing_ids(active[i].current, hidden_banned) for i in hid])
            steps = torch.as_tensor([active[i].hidden_draws for i in hid], device=raw.device)
            hidden_seeds = _stream(seeds_t[hid], 0x68E31DA4)
            tokens = sample_tokens(policy_logprobs(raw, reflect_policy), reflect_policy, hidden_seeds, steps).tolist()
            for j, i in enumerate(hid):
                row, token = active[i], tokens[j]
                row.hidden_draws += 1
                if model_may_end and token == markers.end[0]:
                    main[i], ends[i], reasons[i] = [token], True, "model_end"
                    row.marker_tokens += m_e
                    continue
                row.current.append(token)
                row.hidden_used += 1
                main[i] = [token]
                if len(row.current) >= config.reflect_length:
                    reasons[i] = "length"
                elif row.hidden_used >= config.budget_total:
                    reasons[i] = "budget"
                if peeks or reasons[i]:
                    peek[i] = list(markers.end)
                    ends[i] = bool(reasons[i])
                    if peeks:
                        row.peek_tokens += m_e
                    else:
                        row.marker_tokens += m_e

        if not any(main):
            break
        if config.audit:
            for i, row in enumerate(active):
                row.trace += main[i]
        state, main_logits, peek_logits = step_with_peek(model, state, main, peek, pad_id, config.dual_path)

        # --- peek decisions: stop rows adopt their peek, the others crop it back off
        fed = torch.as_tensor([bool(s) for s in main], device=main_logits.device)
        last = torch.where(fed[:, None], main_logits, state.last_logits)
        if peek_logits is not None:
            peeked = [bool(p) for p in peek]
            idx = [i for i, p in enumerate(peeked) if p]
            if peeks:
                raw = _ban(peek_logits[idx], [_completing_ids(active[i].visible, visible_banned) for i in idx])
                u_peek = uncertainty(policy_logprobs(raw, policy), config.gate, config.gate_top_k).tolist()
                for j, i in enumerate(idx):
                    if u_peek[j] > config.tau_stop:
                        continue
                    if stop_rule == "peek_agree":
                        following = _ban(main_logits[i : i + 1], [_completing_ids(active[i].current, closing)])
                        if not peek_agrees(
                            tokenizer, active[i].current, raw[j], following[0], check_result, markers.end[0]
                        ):
                            continue
                    ends[i], reasons[i] = True, "peek"
            keep = torch.as_tensor([p and e for p, e in zip(peeked, ends, strict=True)], device=last.device)
            last = torch.where(keep[:, None], peek_logits, last)
            state = settle_peeks(state, torch.as_tensor(peeked, device=last.device), keep, len(markers.end))
        state = DecodeState(state.cache, state.attention_mask, state.lengths, last)
        for i, row in enumerate(active):
            if ends[i]:
                if config.audit and peek[i]:
                    row.trace += peek[i]
                row.result.reflection_lengths.append(len(row.current))
                row.result.end_reasons.append(reasons[i])
                row.hidden_mode, row.cooldown, row.since_reflection = False, config.cooldown, 0

        # --- compact finished rows out of the batch
        keep_rows = [i for i, r in enumerate(active) if not r.done]
        if not keep_rows:
            break
        if should_compact(len(active) - len(keep_rows), len(active)):
            state = select(state, keep_rows)
            active = [active[i] for i in keep_rows]

    return [_finish(row, tokenizer, prompts[row.index], stop, config) for row in rows]


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


# --- the decoder ----------------------------------------------------------------------------------------------------


@dataclass
class ReflectiveDecoder:
    """`reflective` and its ablations (`reflective-periodic|random|fixed`, set by config.ablation).

    Besides the counts, each record keeps `trigger_points` (visible steps at a trigger point, which
    `matched_ablations` needs to match the random ablation's rate) and the `end_reasons` of its reflections.
    """

    name: str
    config: ReflectiveConfig
    policy: SamplingPolicy
    seed: int

    def __call__(self, model: Model, tokenizer: Tokenizer, examples: Sequence[Example], task: Task) -> list[Decoded]:
        results = reflective_generate(model, tokenizer, attempt_prompts(tokenizer, examples), self.policy,
                                      example_seeds(self.seed, examples, self.name),
                                      stop_token_ids(model, tokenizer), tokenizer.pad_token_id, self.config)
        return [
            Decoded(r.text, r.token_ids, r.usage, {
                "n_reflections": r.n_reflections, "hidden_tokens": r.hidden_tokens,
                "delta_uncertainty": r.delta_uncertainty, "delta_nll": r.delta_nll,
                "visible_tokens": len(r.token_ids), "trigger_points": sum(r.at_trigger), "end_reasons": r.end_reasons,
            })
            for r in results
        ]
