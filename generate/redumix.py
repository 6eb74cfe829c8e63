"""ReDuMix: attempt, feedback, reflection, then decoding under a per-token mixture
of two contexts, p_mix = softmax(λ·log p(·|x, y<t) + (1−λ)·log p(·|x2, y<t)). This module writes the four stages
once, over the engine protocol (engine.py), and holds the eval decoder; HfEngine's mixture loop is in mixture.py,
vLLM's in vllm_pairs.py.

How it differs from the seed's Algorithm 1, and why:
- One context per example grows through the stages: x, then y1, then r + REFLECT, then c, then REDO. On HfEngine it
  is one KV cache, so the cache that stage 1 built is the prefix of x2, never re-encoded, and context x is a copy of
  the cache taken right after x's prefill; vLLM re-sends the prefix, which its prefix cache finds.
- Both contexts of every example are decoded in step, and policy filters apply to the mixture, not to each context.
  The stored top-k is that of p_mix.
- When x2 would not fit the model's window, the earliest part of y1 is cut and replaced by a short note (not a
  model-written summary: it costs no tokens and keeps the later, most relevant steps). `meta` records the cut.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Literal

from redumix.data.chat import batch_template_pieces, decode_text
from redumix.data.grading import verdict_feedback
from redumix.data.prompts import (
    REDO_INSTRUCTIONS,
    attempt_messages,
    critique_messages,
    redo_messages,
    reflect_messages,
)
from redumix.data.task import Example, Task
from redumix.generate.accounting import Usage
from redumix.generate.decoder import Decoded
from redumix.generate.engine import Contexts, Engine, MixedRedo
from redumix.generate.loop import Generation
from redumix.generate.policy import SamplingPolicy, example_seed
from redumix.generate.redo_window import window_cuts, x2_prefix


@dataclass
class RedumixConfig:
    lam: float = field(default=0.5, metadata={"help": "λ: weight of the original context x (1 = plain decoding)."})
    topk: int = field(default=32, metadata={"help": "Top-k ids of p_mix stored per redo token."})
    feedback: Literal["verifier", "human", "self", "none", "random", "reference"] = field(
        default="verifier",
        metadata={"help": "Where r comes from: the task's answer check, a JSONL file, or the model's critique. "
                  "'reference': the check and the task's reference solution, privileged context for harvests on "
                  "train problems only (task.name=code; eval refuses it). Ablations: 'none' (reflect with no "
                  "feedback) and 'random' (a verdict by coin flip, whatever the answer: wrong half the time)."},
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
    if mode == "reference":
        privileged = getattr(task, "privileged_feedback", None)  # optional, as sub_scores is (data/task.py)
        if privileged is None:
            raise ValueError(f"redumix.feedback=reference shows the task's reference solution, and task "
                             f"{task.name!r} has none to show; use task.name=code, or another redumix.feedback")
        return lambda i, attempt: privileged(attempt, examples[i])
    if mode == "random":
        return lambda i, attempt: verdict_feedback(
            task.answer(attempt), example_seed(seed, f"{examples[i].id}/verdict") % 2 == 0
        )
    raise ValueError(f"redumix.feedback={mode!r} needs its own source (human feedback is read by the harvest)")


def redumix_generate(
    engine: Engine,
    prompts: Sequence[str],
    example_ids: Sequence[str],
    config: RedumixConfig,
    policy: SamplingPolicy,
    seed: int,
    feedback: FeedbackFn | None,
    redos: Sequence[tuple[int, str]] | None = None,
) -> list[RedumixResult]:
    """Run the four ReDuMix stages on a batch of prompts. Each example's noise derives from `seed` and its id.

    `redos`: the redos to draw, each (the prompt it redoes, the id its noise derives from); by default one per
    prompt with the prompt's id. Several of one prompt share its stages 1-3, decoded once (a harvest's attempts of a
    problem, when those stages are greedy and so the same for each); each result counts the shared stages' usage."""
    stages, x_context, x2_context, usage = redo_contexts(engine, prompts, example_ids, config, policy, seed, feedback)
    redos = list(enumerate(example_ids)) if redos is None else list(redos)
    rows = [i for i, _ in redos]
    if rows != list(range(len(prompts))):
        x_context, x2_context = engine.fork(x_context, rows), engine.fork(x2_context, rows)
    found = engine.mix_redo(x_context, x2_context, stage_seeds(seed, [key for _, key in redos], "redo"), config.lam,
                            config.topk, redo_policy(config, policy))
    mode = "self" if feedback is None else config.feedback
    results = []
    for i, redo in zip(rows, found, strict=True):
        result = redo_result(stages, i, redo, replace(usage[i]), config.lam, mode, engine)
        result.meta["engine"] = {"name": engine.name, "retries": redo.retries}
        results.append(result)
    return results


def redo_contexts(
    engine: Engine,
    prompts: Sequence[str],
    example_ids: Sequence[str],
    config: RedumixConfig,
    policy: SamplingPolicy,
    seed: int,
    feedback: FeedbackFn | None,
) -> tuple[RedoStages, Contexts, Contexts, list[Usage]]:
    """Stages 1-3 (attempt, feedback, reflection) and the redo's two contexts, x and x2, ready for
    `engine.mix_redo`; the redo may be decoded from them more than once (at several λ) from `engine.fork`s.

    The prefill and FPE counts are those of a cache that grows in place, positions the model must read once, on
    either engine (an engine that re-sends prefixes finds them in its prefix cache)."""
    tokenizer, stop_ids = engine.tokenizer, engine.stop_ids
    seeds = {stage: stage_seeds(seed, example_ids, stage) for stage in ("attempt", "critique", "reflect")}
    decode = partial(decode_text, tokenizer)
    usage = [Usage() for _ in prompts]

    # --- stage 1: y1 = generate(x), keeping the context; x's own context is kept aside as the redo's first ---
    x_ids = [pieces[0] for pieces in batch_template_pieces(tokenizer, [attempt_messages(p) for p in prompts])]
    state = engine.open(x_ids)
    x_context = engine.fork(state)
    attempts, state = engine.continue_turn(state, seeds["attempt"], policy, policy.max_new_tokens, keep=True)
    y1 = [g.content_ids(stop_ids) for g in attempts]
    y1_text = [decode(ids) for ids in y1]
    for u, x, g in zip(usage, x_ids, attempts, strict=True):
        u.prefill_tokens += len(x)
        u.fpe += len(x) + g.usage.fpe

    # --- stage 2: feedback r, from the task or the model's own critique of [x ‖ y1] (on a fork: c goes on from y1) ---
    if feedback is None:
        critique_convs = [critique_messages(p, t) for p, t in zip(prompts, y1_text, strict=True)]
        pieces = [conv_pieces[-1] for conv_pieces in batch_template_pieces(tokenizer, critique_convs)]
        found, _ = next_turn(engine, engine.fork(state), attempts, y1, pieces, seeds["critique"], policy,
                             config.critique_max_tokens, usage, keep=False)
        r_text = [decode(g.content_ids(stop_ids)) for g in found]
    else:
        r_text = [feedback(i, t) for i, t in enumerate(y1_text)]

    # --- stage 3: c = generate([x ‖ y1 ‖ r ‖ REFLECT]), y1 cut where x2 would overflow the window ---
    reflect_convs = [reflect_messages(p, t, r) for p, t, r in zip(prompts, y1_text, r_text, strict=True)]
    # the template from y1's close to c's open
    reflect_pieces = [pieces[-1] for pieces in batch_template_pieces(tokenizer, reflect_convs)]
    cut = window_cuts(engine.window, tokenizer, y1, x_ids, reflect_convs, reflect_pieces,
                      REDO_INSTRUCTIONS[config.instruction], config.reflection_max_tokens, policy.max_new_tokens)
    y1_in_context = [ids[n:] for ids, n in zip(y1, cut, strict=True)]
    prefixes = [x2_prefix(x, ids, n, tokenizer) for x, ids, n in zip(x_ids, y1_in_context, cut, strict=True)]
    recut = [i for i, n in enumerate(cut) if n]  # a cut row's prefix changed: it is re-encoded whole
    state = engine.reopen(state, recut, [prefixes[i] for i in recut])
    for i in recut:
        usage[i].prefill_tokens += len(prefixes[i])
        usage[i].fpe += len(prefixes[i])
    reflections, state = next_turn(engine, state, attempts, y1_in_context, reflect_pieces, seeds["reflect"], policy,
                                   config.reflection_max_tokens, usage, keep=True, cut=cut)
    c = [g.content_ids(stop_ids) for g in reflections]
    c_text = [decode(ids) for ids in c]

    # --- the redo's contexts: x2 = [x ‖ y1 ‖ r ‖ c ‖ REDO], and x's kept from stage 1 ---
    redo_convs = [redo_messages(p, t, r, ct, REDO_INSTRUCTIONS[config.instruction])
                  for p, t, r, ct in zip(prompts, y1_text, r_text, c_text, strict=True)]
    # the template from c's close to the redo's open
    redo_pieces = [pieces[2] for pieces in batch_template_pieces(tokenizer, redo_convs)]
    segments = [ids[g.cached :] + piece for ids, g, piece in zip(c, reflections, redo_pieces, strict=True)]
    state = engine.extend(state, segments)
    for u, seg in zip(usage, segments, strict=True):
        u.prefill_tokens += len(seg)
        u.fpe += len(seg)
    x2_ids = [pre + tpl_reflect + ct + tpl_redo
              for pre, tpl_reflect, ct, tpl_redo in zip(prefixes, reflect_pieces, c, redo_pieces, strict=True)]
    stages = RedoStages(x_ids, attempts, y1, y1_text, r_text, reflections, c, c_text, cut, x2_ids,
                        engine.lengths(state))
    return stages, x_context, state, usage


def next_turn(
    engine: Engine,
    contexts: Contexts,
    previous: list[Generation],
    previous_ids: list[list[int]],
    pieces: list[list[int]],
    seeds: Sequence[int],
    policy: SamplingPolicy,
    max_tokens: int,
    usage: list[Usage],
    keep: bool,
    cut: Sequence[int] | None = None,
) -> tuple[list[Generation], Contexts | None]:
    """Close the previous assistant turn, add the next user turn, and generate the next assistant turn.

    The segment fed is what of the previous turn the context does not hold yet, then the template's text up to the
    new assistant turn: `pieces`, per row, the last template piece of the conversation that turn answers.
    """
    segments = []
    for i, (gen, ids, piece) in enumerate(zip(previous, previous_ids, pieces, strict=True)):
        already = len(ids) if cut is not None and cut[i] else gen.cached  # a cut row's y1 was re-encoded whole
        segments.append(ids[already:] + piece)
    gens, contexts = engine.continue_turn(engine.extend(contexts, segments), seeds, policy, max_tokens, keep)
    for u, seg, g in zip(usage, segments, gens, strict=True):
        u.prefill_tokens += len(seg)
        u.fpe += len(seg) + g.usage.fpe
    return gens, contexts


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
    redo: MixedRedo,
    usage: Usage,
    lam: float,
    feedback: str,
    engine: Engine,
) -> RedumixResult:
    """Example i's result, its usage completed with the redo."""
    gen, topk_ids, topk_lp, tail_lp = redo.generation, redo.topk_ids, redo.topk_logprobs, redo.tail_logprobs
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
        redo=decode_text(engine.tokenizer, gen.content_ids(engine.stop_ids)),
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


def redo_policy(config: RedumixConfig, policy: SamplingPolicy) -> SamplingPolicy:
    """The redo's policy: `policy` at redumix.redo_temperature where that is set."""
    return policy if config.redo_temperature is None else replace(policy, temperature=config.redo_temperature)


def stage_seeds(global_seed: int, example_ids: Sequence[str], stage: str) -> list[int]:
    return [example_seed(global_seed, f"{eid}/{stage}") for eid in example_ids]


# --- the decoder ----------------------------------------------------------------------------------------------------


@dataclass
class RedumixDecoder:
    """The redo of ReDuMix as an eval decoder: feedback from the task's verifier, or the model's own critique."""

    name: str
    config: RedumixConfig
    policy: SamplingPolicy
    seed: int

    needs_hf_engine = False

    def __call__(self, engine: Engine, examples: Sequence[Example], task: Task) -> list[Decoded]:
        if self.config.feedback in ("human", "reference"):
            raise ValueError(f"eval runs ReDuMix with verifier or self feedback; redumix.feedback="
                             f"{self.config.feedback} is for harvests on train problems")
        feedback = task_feedback(self.config.feedback, task, examples, self.seed)
        results = redumix_generate(engine, [e.prompt for e in examples], [e.id for e in examples], self.config,
                                   self.policy, self.seed, feedback)
        return [
            Decoded(r.redo, r.redo_token_ids, r.usage, {
                "original": r.original, "feedback": r.feedback, "reflection": r.reflection, "lam": r.meta["lam"],
                "original_correct": task.is_correct(r.original, e),
            })
            for r, e in zip(results, examples, strict=True)
        ]
