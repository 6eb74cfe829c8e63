"""ReDuMix's four stages on the vLLM engine: the same token sequences as `redumix.redumix_generate`, built from the
same template pieces and the same sampled ids, and the same per-stage seeds, so a row differs from the Hugging Face
harvest's only by float rounding.

What differs from the Hugging Face path, and why: each stage is a new request whose prompt is the whole context so
far (x ‖ y1 ‖ r ‖ REFLECT ‖ ...), not a cache that grows in place; vLLM's prefix cache finds the earlier stages'
blocks, so the re-sent prefix is mostly not recomputed. The usage counts (`Usage`, FPE) are those of the cache-reusing
Hugging Face path, positions the model must read once, so that the two engines' rows report alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from redumix.data.chat import template_pieces
from redumix.data.prompts import (
    REDO_INSTRUCTIONS,
    attempt_messages,
    critique_messages,
    redo_messages,
    reflect_messages,
)
from redumix.generate.accounting import Usage
from redumix.generate.loop import Generation
from redumix.generate.policy import SamplingPolicy
from redumix.generate.redumix import (
    COMPRESSION_NOTE,
    FeedbackFn,
    RedoStages,
    RedumixConfig,
    RedumixResult,
    redo_policy,
    redo_result,
    stage_seeds,
    window_cuts,
    x2_prefix,
)
from redumix.generate.vllm_engine import VllmEngine


def redumix_generate_vllm(
    engine: VllmEngine,
    tokenizer: PreTrainedTokenizerBase,
    window: int | None,
    prompts: Sequence[str],
    example_ids: Sequence[str],
    config: RedumixConfig,
    policy: SamplingPolicy,
    seed: int,
    stop_ids: Sequence[int],
    feedback: FeedbackFn | None,
) -> list[RedumixResult]:
    """`redumix_generate` on the engine: attempt, feedback, reflection, then the redo as paired requests.
    `window` is the model's max_position_embeddings (y1 is cut to fit it as the Hugging Face path cuts it)."""
    stages, usage = redo_stages_vllm(engine, tokenizer, window, prompts, example_ids, config, policy, seed, stop_ids,
                                     feedback)
    redos = engine.mix(stages.x_ids, stages.x2_ids, stage_seeds(seed, example_ids, "redo").tolist(), config.lam,
                       config.topk, redo_policy(config, policy), stop_ids, policy.max_new_tokens)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    mode = "self" if feedback is None else config.feedback
    results = []
    for i, redo in enumerate(redos):
        gen = redo.generation
        result = redo_result(stages, i, (gen, redo.topk_ids, redo.topk_logprobs, redo.tail_logprobs), usage[i],
                             config.lam, mode, decode, stop_ids)
        result.meta["engine"] = {"name": "vllm", "retries": redo.retries}
        results.append(result)
    return results


def redo_stages_vllm(
    engine: VllmEngine,
    tokenizer: PreTrainedTokenizerBase,
    window: int | None,
    prompts: Sequence[str],
    example_ids: Sequence[str],
    config: RedumixConfig,
    policy: SamplingPolicy,
    seed: int,
    stop_ids: Sequence[int],
    feedback: FeedbackFn | None,
) -> tuple[RedoStages, list[Usage]]:
    """Stages 1-3 (attempt, feedback, reflection) and the redo's two prompts, x and x2, as `redo_contexts` builds
    them on the Hugging Face path; the redo may then be decoded from them at several λ (`engine.mix`)."""
    seeds = {stage: stage_seeds(seed, example_ids, stage).tolist() for stage in ("attempt", "critique", "reflect")}
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    usage = [Usage() for _ in prompts]

    # --- stage 1: y1 = generate(x) ---
    x_ids = [template_pieces(tokenizer, attempt_messages(p))[0] for p in prompts]
    attempts = engine.generate(x_ids, seeds["attempt"], policy, stop_ids, policy.max_new_tokens)
    y1 = [g.content_ids(stop_ids) for g in attempts]
    y1_text = [decode(ids) for ids in y1]
    for u, x, g in zip(usage, x_ids, attempts, strict=True):
        u.prefill_tokens += len(x)
        u.fpe += len(x) + g.usage.fpe

    # --- stage 2: feedback r, from the task or the model's own critique of [x ‖ y1] ---
    if feedback is None:
        pieces = [template_pieces(tokenizer, critique_messages(p, t))[-1] for p, t in zip(prompts, y1_text,
                                                                                           strict=True)]
        critiques = _continue(engine, [x + y for x, y in zip(x_ids, y1, strict=True)], attempts, y1, pieces,
                              seeds["critique"], policy, stop_ids, config.critique_max_tokens, usage)
        r_text = [decode(g.content_ids(stop_ids)) for g in critiques]
    else:
        r_text = [feedback(i, t) for i, t in enumerate(y1_text)]

    # --- stage 3: c = generate([x ‖ y1 ‖ r ‖ REFLECT]), y1 cut where x2 would overflow the window ---
    reflect_convs = [reflect_messages(p, t, r) for p, t, r in zip(prompts, y1_text, r_text, strict=True)]
    reflect_pieces = [template_pieces(tokenizer, conv)[-1] for conv in reflect_convs]
    cut = window_cuts(window, tokenizer, y1, x_ids, reflect_convs, reflect_pieces, config, policy)
    y1_in_context = [ids[n:] for ids, n in zip(y1, cut, strict=True)]
    prefixes = [x2_prefix(x, ids, n, tokenizer) for x, ids, n in zip(x_ids, y1_in_context, cut, strict=True)]
    for i, n in enumerate(cut):
        if n:  # the Hugging Face path re-encodes a cut row whole: x ‖ note ‖ the rest of y1
            note = len(tokenizer(COMPRESSION_NOTE, add_special_tokens=False)["input_ids"])
            usage[i].prefill_tokens += len(x_ids[i]) + note + len(y1[i]) - n
            usage[i].fpe += len(x_ids[i]) + note + len(y1[i]) - n
    already = [len(y) if n else None for y, n in zip(y1_in_context, cut, strict=True)]
    reflections = _continue(engine, prefixes, attempts, y1_in_context, reflect_pieces, seeds["reflect"], policy,
                            stop_ids, config.reflection_max_tokens, usage, already)
    c = [g.content_ids(stop_ids) for g in reflections]
    c_text = [decode(ids) for ids in c]

    # --- stage 4: x2 = [x ‖ y1 ‖ r ‖ c ‖ REDO]; the redo as a pair of requests, x and x2 ---
    instruction = REDO_INSTRUCTIONS[config.instruction]
    redo_convs = [redo_messages(p, t, r, ct, instruction)
                  for p, t, r, ct in zip(prompts, y1_text, r_text, c_text, strict=True)]
    redo_pieces = [template_pieces(tokenizer, conv)[2] for conv in redo_convs]
    x2_ids = [pre + rp + ct + dp for pre, rp, ct, dp in zip(prefixes, reflect_pieces, c, redo_pieces, strict=True)]
    for u, ct, g, dp in zip(usage, c, reflections, redo_pieces, strict=True):
        u.prefill_tokens += len(ct) - g.cached + len(dp)
        u.fpe += len(ct) - g.cached + len(dp)
    stages = RedoStages(x_ids, attempts, y1, y1_text, r_text, reflections, c, c_text, cut, x2_ids,
                        [len(ids) for ids in x2_ids])
    return stages, usage


def _continue(
    engine: VllmEngine,
    prefixes: list[list[int]],
    previous: list[Generation],
    previous_ids: list[list[int]],
    pieces: list[list[int]],
    seeds: list[int],
    policy: SamplingPolicy,
    stop_ids: Sequence[int],
    max_tokens: int,
    usage: list[Usage],
    already: list[int | None] | None = None,
) -> list[Generation]:
    """The next assistant turn after [prefix ‖ piece]; usage as the cache-reusing path counts it (the part of the
    previous turn not yet cached, then the template's piece, then the new turn's decode steps)."""
    prompts = [pre + piece for pre, piece in zip(prefixes, pieces, strict=True)]
    gens = engine.generate(prompts, seeds, policy, stop_ids, max_tokens)
    for i, (u, gen, ids, piece, g) in enumerate(zip(usage, previous, previous_ids, pieces, gens, strict=True)):
        cached = already[i] if already and already[i] is not None else gen.cached
        u.prefill_tokens += len(ids) - cached + len(piece)
        u.fpe += len(ids) - cached + len(piece) + g.usage.fpe
    return gens
