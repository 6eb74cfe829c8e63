"""ReDuMix: attempt, feedback, reflection, then decoding under a per-token mixture
of two contexts, p_mix = softmax(λ·log p(·|x, y<t) + (1−λ)·log p(·|x2, y<t)). This module stages the four steps
on one growing cache and holds the eval decoder; the mixture and its decode loop are in mixture.py.

How it differs from the seed's Algorithm 1, and why:
- One KV cache per example grows through the stages: x, then y1, then r + REFLECT, then c, then REDO. The cache
  that stage 1 built is the prefix of x2, never re-encoded. Context x is a copy of the cache taken right after x's
  prefill, so the redo's two contexts cost nothing extra to set up.
- Both contexts of every example go through one batched forward pass per token, and policy filters apply to the
  mixture, not to each context (mixture.py, which holds the redo's decode loop). The stored top-k is that of p_mix.
- When x2 would not fit the model's window, the earliest part of y1 is cut and replaced by a short note (not a
  model-written summary: it costs no tokens and keeps the later, most relevant steps). `meta` records the cut.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from redumix.data.chat import template_pieces
from redumix.data.grading import verdict_feedback
from redumix.data.prompts import REDO_INSTRUCTIONS, attempt_messages, redo_messages, reflect_messages
from redumix.data.task import Example, Task
from redumix.generate.accounting import Usage
from redumix.generate.decoder import Decoded, Model, Tokenizer
from redumix.generate.loop import Generation
from redumix.generate.mixture import mixture_loop
from redumix.generate.model_io import stop_token_ids
from redumix.generate.plain import sample_loop
from redumix.generate.policy import SamplingPolicy, example_seed
from redumix.generate.state import DecodeState, clone, extend, merge, prefill, select
from redumix.generate.turns import critiques, next_turn

COMPRESSION_NOTE = "(earlier steps omitted) "


@dataclass
class RedumixConfig:
    lam: float = field(default=0.5, metadata={"help": "λ: weight of the original context x (1 = plain decoding)."})
    topk: int = field(default=32, metadata={"help": "Top-k ids of p_mix stored per redo token."})
    feedback: Literal["verifier", "human", "self", "none", "random"] = field(
        default="verifier",
        metadata={"help": "Where r comes from: the task's answer check, a JSONL file, or the model's critique. "
                  "Ablations: 'none' (reflect with no feedback) and 'random' (a verdict by coin flip, whatever the "
                  "answer: wrong half the time)."},
    )
    feedback_file: str = field(default="", metadata={"help": "human feedback: JSONL lines with 'id' and 'feedback'."})
    reflection_max_tokens: int = field(default=256, metadata={"help": "Most tokens in the reflection c."})
    critique_max_tokens: int = field(default=48, metadata={"help": "Most tokens in a self-critique r."})
    instruction: Literal["redo", "fresh", "answer"] = field(
        default="redo",
        metadata={"help": "The last user turn of x2: 'redo', the ReDuMix paper's; 'fresh', which asks for a new "
                  "solution rather than a rewrite; 'answer', which asks for the reply alone, with no talk about "
                  "the task (data/prompts.py, REDO_INSTRUCTIONS)."},
    )
    redo_temperature: float | None = field(
        default=None,
        metadata={"help": "Temperature of the redo (and of the ladder's resamples); None keeps `sampling`'s, which "
                  "the attempt, critique and reflection follow."},
    )

    def __post_init__(self) -> None:
        problems = []
        if self.redo_temperature is not None and self.redo_temperature < 0:
            problems.append(f"redo_temperature must be >= 0, got {self.redo_temperature}")
        if not 0 <= self.lam <= 1:
            problems.append(f"lam must be in [0, 1], got {self.lam}")
        if self.topk < 1:
            problems.append(f"topk must be >= 1, got {self.topk}")
        if self.feedback == "human" and not self.feedback_file:
            problems.append("feedback 'human' needs feedback_file (JSONL with 'id' and 'feedback' per line)")
        if self.reflection_max_tokens < 1 or self.critique_max_tokens < 1:
            problems.append("reflection_max_tokens and critique_max_tokens must be >= 1")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class RedumixResult:
    original: str  # y1
    original_ids: list[int]
    feedback: str  # r
    reflection: str  # c
    reflection_ids: list[int]  # c as sampled (its text drops special tokens, so it may not re-tokenize to this)
    redo: str  # y
    redo_token_ids: list[int]  # every sampled id of y, the stop token included when it ended on one
    topk_ids: list[list[int]]  # per redo token: top-k ids of p_mix, most likely first
    topk_logprobs: list[list[float]]  # their log p_mix
    tail_logprobs: list[float]  # per redo token: log of p_mix's mass outside the top-k (-inf if k covers V)
    x2_ids: list[int]  # the ids of x2 = [x ‖ y1 ‖ r ‖ c ‖ REDO] exactly as cached (the on-policy teacher's context)
    usage: Usage
    meta: dict = field(default_factory=dict)


# Feedback for example i given the text of its attempt; None asks the model for a self-critique.
FeedbackFn = Callable[[int, str], str]


def task_feedback(mode: str, task: Task, examples: Sequence[Example], seed: int) -> FeedbackFn | None:
    """r for each example of a batch: the task's verifier, none, a coin-flip verdict, or None (self-critique).

    `random` names the attempt's own answer with a verdict drawn from the example's id, independent of the truth,
    so it is wrong half the time: the control that shows whether the verdict carries the gain.
    """
    if mode == "self":
        return None
    if mode == "verifier":
        return lambda i, attempt: task.feedback(attempt, examples[i])
    if mode == "none":
        return lambda i, attempt: ""
    if mode == "random":
        return lambda i, attempt: verdict_feedback(
            task.answer(attempt), example_seed(seed, f"{examples[i].id}/verdict") % 2 == 0
        )
    raise ValueError(f"redumix.feedback={mode!r} needs its own source (human feedback is read by the harvest)")


def redumix_generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    example_ids: Sequence[str],
    config: RedumixConfig,
    policy: SamplingPolicy,
    seed: int,
    stop_ids: Sequence[int],
    feedback: FeedbackFn | None,
) -> list[RedumixResult]:
    """Run the four ReDuMix stages on a batch of prompts. Each example's noise derives from `seed` and its id."""
    stages, x_context, x2_context, usage = redo_contexts(model, tokenizer, prompts, example_ids, config, policy, seed,
                                                         stop_ids, feedback)
    seeds = stage_seeds(seed, example_ids, "redo")
    redo = mixture_loop(model, x_context, x2_context, config.lam, config.topk, redo_policy(config, policy), seeds,
                        stop_ids)
    mode = "self" if feedback is None else config.feedback
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    return [redo_result(stages, i, products, usage[i], config.lam, mode, decode, stop_ids)
            for i, products in enumerate(redo)]


def redo_contexts(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    example_ids: Sequence[str],
    config: RedumixConfig,
    policy: SamplingPolicy,
    seed: int,
    stop_ids: Sequence[int],
    feedback: FeedbackFn | None,
) -> tuple[RedoStages, DecodeState, DecodeState, list[Usage]]:
    """Stages 1-3 (attempt, feedback, reflection) and the redo's two contexts: x's cache and x2's, ready for
    `mixture_loop`. The redo may be decoded from them more than once (at several λ) from `clone`s."""
    pad_id = tokenizer.pad_token_id
    seeds = {stage: stage_seeds(seed, example_ids, stage) for stage in ("attempt", "critique", "reflect")}
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    usage = [Usage() for _ in prompts]

    # --- stage 1: y1 = generate(x), keeping the cache; x's own cache is kept aside as the redo's first context ---
    x_ids = [template_pieces(tokenizer, attempt_messages(p))[0] for p in prompts]
    state = prefill(model, x_ids, pad_id)
    x_context = clone(state)
    stage1 = sample_loop(model, state, policy, seeds["attempt"], stop_ids, keep_state=True)
    attempts, state = stage1.generations, stage1.state
    y1 = [g.content_ids(stop_ids) for g in attempts]
    y1_text = [decode(ids) for ids in y1]
    for u, x, g in zip(usage, x_ids, attempts, strict=True):
        u.prefill_tokens += len(x)
        u.fpe += len(x) + g.usage.fpe

    # --- stage 2: feedback r ---
    if feedback is None:
        r_text = critiques(model, tokenizer, state, attempts, y1, prompts, y1_text, config.critique_max_tokens,
                           policy, seeds["critique"], stop_ids, usage)
    else:
        r_text = [feedback(i, t) for i, t in enumerate(y1_text)]

    # --- stage 3: c = generate([x ‖ y1 ‖ r ‖ REFLECT]), compressing y1 where x2 would overflow the window ---
    reflect_convs = [reflect_messages(p, t, r) for p, t, r in zip(prompts, y1_text, r_text, strict=True)]
    reflect_pieces = [template_pieces(tokenizer, conv)[-1] for conv in reflect_convs]  # from y1's close to c's open
    state, cut = _fit_window(
        model, tokenizer, state, attempts, y1, x_ids, reflect_convs, reflect_pieces, config, policy, usage
    )
    y1_in_context = [ids[n:] for ids, n in zip(y1, cut, strict=True)]
    reflections, state = next_turn(
        model, tokenizer, state, attempts, y1_in_context, stop_ids, policy, seeds["reflect"], reflect_pieces,
        config.reflection_max_tokens, usage, keep_state=True, cut=cut,
    )
    c = [g.content_ids(stop_ids) for g in reflections]
    c_text = [decode(ids) for ids in c]

    # --- the redo's contexts: x2 = [x ‖ y1 ‖ r ‖ c ‖ REDO], and x's cache kept from stage 1 ---
    redo_convs = [redo_messages(p, t, r, ct, REDO_INSTRUCTIONS[config.instruction])
                  for p, t, r, ct in zip(prompts, y1_text, r_text, c_text, strict=True)]
    redo_pieces = [template_pieces(tokenizer, conv)[2] for conv in redo_convs]  # from c's close to the redo's open
    segments = [ids[g.cached :] + piece for ids, g, piece in zip(c, reflections, redo_pieces, strict=True)]
    state = extend(model, state, segments, pad_id)
    for u, seg in zip(usage, segments, strict=True):
        u.prefill_tokens += len(seg)
        u.fpe += len(seg)
    x2_ids = [
        x2_prefix(x, ids, n, tokenizer) + tpl_reflect + ct + tpl_redo
        for x, ids, n, tpl_reflect, ct, tpl_redo in zip(
            x_ids, y1_in_context, cut, reflect_pieces, c, redo_pieces, strict=True
        )
    ]
    stages = RedoStages(x_ids, attempts, y1, y1_text, r_text, reflections, c, c_text, cut, x2_ids,
                        state.lengths.tolist())
    return stages, x_context, state, usage


@dataclass
class RedoStages:
    """What stages 1-3 made and how x2 was built, per example of the batch."""

    x_ids: list[list[int]]
    attempts: list[Generation]
    y1: list[list[int]]
    y1_text: list[str]
    r_text: list[str]
    reflections: list[Generation]
    c: list[list[int]]
    c_text: list[str]
    cut: list[int]  # tokens of y1 cut to fit the window
    x2_ids: list[list[int]]
    x2_lengths: list[int]  # positions the cache holds for x2


def redo_result(
    stages: RedoStages,
    i: int,
    redo: tuple[Generation, list[list[int]], list[list[float]], list[float]],
    usage: Usage,
    lam: float,
    feedback: str,
    decode: Callable[[list[int]], str],
    stop_ids: Sequence[int],
) -> RedumixResult:
    """Example i's result, its usage completed with the redo."""
    gen, topk_ids, topk_lp, tail_lp = redo
    attempt, reflection = stages.attempts[i], stages.reflections[i]
    usage.fpe += gen.usage.fpe
    usage.generated_tokens = sum(len(g.token_ids) for g in (attempt, reflection, gen))
    usage.visible_tokens = len(gen.token_ids)
    return RedumixResult(
        original=stages.y1_text[i],
        original_ids=stages.y1[i],
        feedback=stages.r_text[i],
        reflection=stages.c_text[i],
        reflection_ids=stages.c[i],
        redo=decode(gen.content_ids(stop_ids)),
        redo_token_ids=gen.token_ids,
        topk_ids=topk_ids,
        topk_logprobs=topk_lp,
        tail_logprobs=tail_lp,
        x2_ids=stages.x2_ids[i],
        usage=usage,
        meta={
            "lam": lam,
            "feedback": feedback,
            "tokens": {
                "x": len(stages.x_ids[i]),
                "x2": stages.x2_lengths[i],
                "original": len(attempt.token_ids),
                "reflection": len(reflection.token_ids),
                "redo": len(gen.token_ids),
            },
            "finished": {"original": attempt.finished, "reflection": reflection.finished, "redo": gen.finished},
            "y1_compressed_tokens": stages.cut[i],
            "fpe": usage.fpe,
            "prefill_tokens": usage.prefill_tokens,
        },
    )


def x2_prefix(x: list[int], y1: list[int], cut: int, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """x ‖ y1 as the cache holds it: a row whose y1 was cut to fit the window holds x ‖ note ‖ the rest of y1."""
    if not cut:
        return x + y1
    return x + tokenizer(COMPRESSION_NOTE, add_special_tokens=False)["input_ids"] + y1


def redo_policy(config: RedumixConfig, policy: SamplingPolicy) -> SamplingPolicy:
    """The redo's policy: `policy` at redumix.redo_temperature where that is set."""
    return policy if config.redo_temperature is None else replace(policy, temperature=config.redo_temperature)


def stage_seeds(global_seed: int, example_ids: Sequence[str], stage: str) -> torch.Tensor:
    return torch.tensor([example_seed(global_seed, f"{eid}/{stage}") for eid in example_ids], dtype=torch.long)


def window_cuts(
    window: int | None,
    tokenizer: PreTrainedTokenizerBase,
    y1: list[list[int]],
    x_ids: list[list[int]],
    reflect_convs: list[list[dict]],
    reflect_pieces: list[list[int]],
    config: RedumixConfig,
    policy: SamplingPolicy,
) -> list[int]:
    """Tokens of y1 to cut per row so that x2 and the redo fit the window (the vLLM harvest uses it too)."""
    if not window:
        return [0] * len(y1)
    # Worst case of x2 plus the redo: x ‖ y1 ‖ r + REFLECT ‖ c (at its cap) ‖ REDO ‖ y (at its cap).
    redo_piece = [
        template_pieces(tokenizer, [*conv, {"role": "assistant", "content": ""},
                                    {"role": "user", "content": REDO_INSTRUCTIONS[config.instruction]}])[2]
        for conv in reflect_convs
    ]
    note_len = len(tokenizer(COMPRESSION_NOTE, add_special_tokens=False)["input_ids"])
    cut = []
    for x, ids, piece1, piece2 in zip(x_ids, y1, reflect_pieces, redo_piece, strict=True):
        worst = len(x) + len(ids) + len(piece1) + config.reflection_max_tokens + len(piece2) + policy.max_new_tokens
        overflow = worst - window
        # An attempt no longer than the note cannot be shortened by replacing its start with the note.
        cut.append(0 if overflow <= 0 or len(ids) <= note_len else min(len(ids), overflow + note_len))
    return cut


def _fit_window(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    state: DecodeState,
    attempts: list[Generation],
    y1: list[list[int]],
    x_ids: list[list[int]],
    reflect_convs: list[list[dict]],
    reflect_pieces: list[list[int]],
    config: RedumixConfig,
    policy: SamplingPolicy,
    usage: list[Usage],
) -> tuple[DecodeState, list[int]]:
    """Cut the earliest tokens of y1 where x2 could outgrow the window. Returns the state and tokens cut per row.

    A cut row cannot reuse its cache (its prefix changed): it is re-encoded as x ‖ note ‖ tail of y1, and the
    stage-3 segment for it is then only the template text after y1.
    """
    window = getattr(model.config, "max_position_embeddings", None)
    cut = window_cuts(window, tokenizer, y1, x_ids, reflect_convs, reflect_pieces, config, policy)
    if not any(cut):
        return state, cut
    note = tokenizer(COMPRESSION_NOTE, add_special_tokens=False)["input_ids"]
    keep = [i for i, n in enumerate(cut) if n == 0]
    redo_rows = [i for i, n in enumerate(cut) if n]
    fresh = prefill(model, [x_ids[i] + note + y1[i][cut[i] :] for i in redo_rows], tokenizer.pad_token_id)
    for i in redo_rows:
        usage[i].prefill_tokens += len(x_ids[i]) + len(note) + len(y1[i]) - cut[i]
        usage[i].fpe += len(x_ids[i]) + len(note) + len(y1[i]) - cut[i]
    parts = ([select(state, keep)] if keep else []) + [fresh]
    order = keep + redo_rows
    merged = merge(parts)
    return select(merged, [order.index(i) for i in range(len(order))]), cut


# --- the decoder ----------------------------------------------------------------------------------------------------


@dataclass
class RedumixDecoder:
    """The redo of ReDuMix as an eval decoder: feedback from the task's verifier, or the model's own critique."""

    name: str
    config: RedumixConfig
    policy: SamplingPolicy
    seed: int

    def __call__(self, model: Model, tokenizer: Tokenizer, examples: Sequence[Example], task: Task) -> list[Decoded]:
        if self.config.feedback == "human":
            raise ValueError("eval runs ReDuMix with verifier or self feedback; human feedback is for the harvest")
        feedback = task_feedback(self.config.feedback, task, examples, self.seed)
        results = redumix_generate(model, tokenizer, [e.prompt for e in examples], [e.id for e in examples],
                                   self.config, self.policy, self.seed, stop_token_ids(model, tokenizer), feedback)
        return [
            Decoded(r.redo, r.redo_token_ids, r.usage, {
                "original": r.original, "feedback": r.feedback, "reflection": r.reflection, "lam": r.meta["lam"],
                "original_correct": task.is_correct(r.original, e),
            })
            for r, e in zip(results, examples, strict=True)
        ]
