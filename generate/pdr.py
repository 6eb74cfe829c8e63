"""Parallel-Distill-Refine and Sequential Refinement (Madaan et al., "Rethinking Thinking Tokens").

Round 1 writes N drafts per example in parallel. Each later round distills the previous drafts into a text
workspace of at most W tokens and writes N new drafts conditioned on [question ‖ workspace]. The context a round
sees is therefore bounded by the question, W and one draft, however many tokens the rounds generate in total.
N = 1 is Sequential Refinement: the same code with one draft, whose workspace is that draft.

What differs from the paper, and why:
- `distill="extract"` (the default) builds the workspace without the model: distinct final answers ranked by vote,
  one draft each, then further whole drafts while they fit. The embedded tiny model cannot summarise, and ranking
  by vote is the paper's own "global summary" baseline. `distill="model"` asks the model for a summary of at most
  W tokens instead.
- The question's prompt is prefilled once per example and its cache copied to the N drafts, so FPE counts it once.
- Round 1's first draft uses the example's own seed, so it is exactly what plain decoding writes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from redumix.data.chat import decode_text, prompt_ids
from redumix.data.prompts import attempt_messages, distill_messages, format_workspace, refine_messages
from redumix.data.task import Example, Task
from redumix.generate.accounting import Usage
from redumix.generate.decoder import Decoded, example_seeds
from redumix.generate.engine import Engine
from redumix.generate.hf_engine import hf_parts
from redumix.generate.loop import Generation
from redumix.generate.model_io import stop_token_ids
from redumix.generate.plain import generate_batch, sample_loop
from redumix.generate.policy import SamplingPolicy, example_seed
from redumix.generate.state import prefill, select


@dataclass
class PdrConfig:
    drafts: int = field(default=4, metadata={"help": "N drafts per round (1 = Sequential Refinement)."})
    rounds: int = field(default=2, metadata={"help": "R refine rounds after the first drafts (0 = majority vote)."})
    workspace_tokens: int = field(default=192, metadata={"help": "W: the distilled workspace's token bound."})
    distill: Literal["extract", "model"] = field(
        default="extract",
        metadata={
            "help": "extract: answers ranked by vote, with whole drafts that fit in W; model: the model summarises."
        },
    )
    draft_temperature: float | None = field(
        default=None,
        metadata={
            "help": "Drafts' temperature; None keeps the policy's (a greedy policy makes the N drafts identical)."
        },
    )

    def __post_init__(self) -> None:
        problems = []
        if self.drafts < 1:
            problems.append(f"drafts must be >= 1, got {self.drafts}")
        if self.rounds < 0:
            problems.append(f"rounds must be >= 0, got {self.rounds}")
        if self.workspace_tokens < 1:
            problems.append(f"workspace_tokens must be >= 1, got {self.workspace_tokens}")
        if self.draft_temperature is not None and self.draft_temperature < 0:
            problems.append(f"draft_temperature must be >= 0, got {self.draft_temperature}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class PdrRound:
    workspace: str  # what this round's drafts were conditioned on ("" in round 1)
    drafts: list[str]
    answers: list[str | None]
    context_tokens: int  # the round's prompt: question, template and workspace
    draft_tokens: int  # tokens sampled across the N drafts
    distill_tokens: int = 0  # tokens the model sampled distilling these drafts (distill="model")
    longest_context: int = 0  # prompt + longest draft, or distill prompt + summary


@dataclass
class PdrResult:
    text: str  # the final draft
    token_ids: list[int]  # its tokens, without the stop token
    answer: str | None
    usage: Usage
    rounds: list[PdrRound]

    @property
    def tokens_per_round(self) -> list[int]:
        return [r.draft_tokens + r.distill_tokens for r in self.rounds]

    @property
    def longest_context(self) -> int:
        return max(r.longest_context for r in self.rounds)


# --- workspace ----------------------------------------------------------------------------------------------------


def token_count(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def fit_tokens(tokenizer: PreTrainedTokenizerBase, text: str, budget: int, keep_end: bool = False) -> str:
    """`text` cut to at most `budget` tokens (counted by re-tokenizing, since decode/encode need not round-trip)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    keep = min(budget, len(ids))
    while keep > 0:
        piece = decode_text(tokenizer, ids[-keep:] if keep_end else ids[:keep])
        overshoot = token_count(tokenizer, piece) - budget
        if overshoot <= 0:
            return piece
        keep -= overshoot
    return ""


def rank_drafts(answers: Sequence[str | None]) -> list[int]:
    """Draft indices: one per distinct answer by descending votes, then the rest; drafts with no answer last."""
    votes: Counter[str | None] = Counter(a for a in answers if a is not None)
    by_votes = sorted(range(len(answers)), key=lambda i: (-votes.get(answers[i], 0), i))
    representatives, seen = [], set()
    for i in by_votes:
        if answers[i] is not None and answers[i] not in seen:
            seen.add(answers[i])
            representatives.append(i)
    return representatives + [i for i in by_votes if i not in representatives]


AnswerFn = Callable[[str], str | None]  # the task's answer extraction, for voting


def extract_workspace(
    tokenizer: PreTrainedTokenizerBase, drafts: Sequence[str], budget: int, answer: AnswerFn
) -> str:
    """The model-free distill: ranked distinct drafts, whole, while the workspace stays within `budget` tokens."""
    answers = [answer(d) for d in drafts]
    order = [i for i in rank_drafts(answers) if drafts[i].strip()]
    chosen: list[str] = []
    for i in order:
        text = drafts[i].strip()
        if text not in chosen and token_count(tokenizer, format_workspace([*chosen, text])) <= budget:
            chosen.append(text)
    if chosen or not order:
        return format_workspace(chosen)
    # Not one whole draft fits: keep the end of the best-ranked one, where its answer is.
    room = budget - token_count(tokenizer, format_workspace(["..."]))
    while room > 0:
        tail = fit_tokens(tokenizer, drafts[order[0]].strip(), room, keep_end=True)
        workspace = format_workspace(["..." + tail])
        overshoot = token_count(tokenizer, workspace) - budget  # tokens may merge across the join
        if overshoot <= 0:
            return workspace
        room -= overshoot
    return ""


# --- rounds -------------------------------------------------------------------------------------------------------


def draft_seed(seed: int, round_index: int, draft: int) -> int:
    return seed if round_index == 0 and draft == 0 else example_seed(seed, f"pdr/{round_index}/{draft}")


def write_drafts(
    model: PreTrainedModel,
    contexts: Sequence[Sequence[int]],
    policy: SamplingPolicy,
    seeds: Sequence[Sequence[int]],
    stop_ids: Sequence[int],
    pad_id: int,
) -> list[list[Generation]]:
    """len(seeds[b]) drafts for each context b, in one batch; each context is prefilled once and its cache copied."""
    drafts = len(seeds[0])
    state = prefill(model, contexts, pad_id)
    state = select(state, [b for b in range(len(contexts)) for _ in range(drafts)])
    flat_seeds = torch.as_tensor([s for row in seeds for s in row])
    gens = sample_loop(model, state, policy, flat_seeds, stop_ids).generations
    return [gens[b * drafts : (b + 1) * drafts] for b in range(len(contexts))]


def model_distill(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    drafts: Sequence[Sequence[str]],
    policy: SamplingPolicy,
    seeds: Sequence[int],
    stop_ids: Sequence[int],
    budget: int,
) -> tuple[list[str], list[Generation]]:
    """The model's own summaries of each example's drafts, cut to `budget` tokens."""
    contexts = [prompt_ids(tokenizer, distill_messages(p, list(d))) for p, d in zip(prompts, drafts, strict=True)]
    gens = generate_batch(model, contexts, policy, seeds, stop_ids, pad_id(tokenizer), max_new_tokens=budget)
    texts = [decode_text(tokenizer, g.content_ids(stop_ids)) for g in gens]
    return [fit_tokens(tokenizer, t, budget) for t in texts], gens


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def majority_draft(answers: Sequence[str | None]) -> int:
    """The first draft holding the most-voted answer (the first draft when none has an answer)."""
    votes: Counter[str | None] = Counter(a for a in answers if a is not None)
    if not votes:
        return 0
    best = max(votes.values())
    return next(i for i, a in enumerate(answers) if a is not None and votes[a] == best)


# --- the decoder --------------------------------------------------------------------------------------------------


def pdr_generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    policy: SamplingPolicy,
    seeds: Sequence[int],
    stop_ids: Sequence[int],
    config: PdrConfig,
    answer: AnswerFn,
) -> list[PdrResult]:
    """PDR (N = config.drafts > 1) or SR (N = 1) over a batch of questions; one result per question.

    `answer` reads a draft's final answer (the task's extraction): drafts vote with it.
    """
    draft_policy = (
        policy if config.draft_temperature is None else replace(policy, temperature=config.draft_temperature)
    )
    usages = [Usage() for _ in prompts]
    rounds: list[list[PdrRound]] = [[] for _ in prompts]
    workspaces = [""] * len(prompts)
    last: list[list[Generation]] = []
    for round_index in range(config.rounds + 1):
        # --- refine (round 1: draft from the question alone)
        messages = [
            attempt_messages(p) if round_index == 0 else refine_messages(p, w)
            for p, w in zip(prompts, workspaces, strict=True)
        ]
        contexts = [prompt_ids(tokenizer, m) for m in messages]
        round_seeds = [[draft_seed(s, round_index, d) for d in range(config.drafts)] for s in seeds]
        last = write_drafts(model, contexts, draft_policy, round_seeds, stop_ids, pad_id(tokenizer))
        texts = [[decode_text(tokenizer, g.content_ids(stop_ids)) for g in gens] for gens in last]
        for b, gens in enumerate(last):
            sampled = sum(len(g.token_ids) for g in gens)
            usages[b].prefill_tokens += len(contexts[b])
            usages[b].fpe += len(contexts[b]) + sum(g.usage.fpe for g in gens)
            usages[b].generated_tokens += sampled
            rounds[b].append(
                PdrRound(
                    workspace=workspaces[b],
                    drafts=texts[b],
                    answers=[answer(t) for t in texts[b]],
                    context_tokens=len(contexts[b]),
                    draft_tokens=sampled,
                    longest_context=len(contexts[b]) + max(len(g.token_ids) for g in gens),
                )
            )
        if round_index == config.rounds:
            break
        # --- distill into the next round's workspace
        if config.distill == "extract":
            workspaces = [extract_workspace(tokenizer, t, config.workspace_tokens, answer) for t in texts]
            continue
        distill_seeds = [example_seed(s, f"pdr/{round_index}/distill") for s in seeds]
        workspaces, summaries = model_distill(
            model, tokenizer, prompts, texts, policy, distill_seeds, stop_ids, config.workspace_tokens
        )
        for b, gen in enumerate(summaries):
            usages[b].add(replace(gen.usage, visible_tokens=0))
            round_log = rounds[b][-1]
            round_log.distill_tokens = len(gen.token_ids)
            distill_context = gen.usage.prefill_tokens + len(gen.token_ids)
            round_log.longest_context = max(round_log.longest_context, distill_context)
    return [_final(gens, usage, log, stop_ids) for gens, usage, log in zip(last, usages, rounds, strict=True)]


def _final(gens: list[Generation], usage: Usage, rounds: list[PdrRound], stop_ids: Sequence[int]) -> PdrResult:
    """The last round's majority draft, with the accounting of every round."""
    pick = majority_draft(rounds[-1].answers)
    token_ids = gens[pick].content_ids(stop_ids)
    usage.visible_tokens = len(token_ids)
    return PdrResult(rounds[-1].drafts[pick], token_ids, rounds[-1].answers[pick], usage, rounds)


@dataclass
class PdrDecoder:
    """`pdr` (N drafts a round) or `sr` (one draft a round, Sequential Refinement)."""

    name: str
    config: PdrConfig
    policy: SamplingPolicy
    seed: int

    needs_hf_engine = True  # its rounds read and extend the cache of each draft

    def __call__(self, engine: Engine, examples: Sequence[Example], task: Task) -> list[Decoded]:
        model, tokenizer = hf_parts(engine)
        results = pdr_generate(model, tokenizer, [e.prompt for e in examples], self.policy,
                               example_seeds(self.seed, examples, self.name), stop_token_ids(model, tokenizer),
                               self.config, task.answer)
        return [
            Decoded(r.text, r.token_ids, r.usage, {
                "tokens_per_round": r.tokens_per_round, "longest_context": r.longest_context,
                "rounds": [asdict(x) for x in r.rounds],
            })
            for r in results
        ]
