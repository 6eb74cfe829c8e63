"""The embedded base's training text: `CorpusSpec` (the mix), the five episode builders and `corpus_episodes`.

The base is trained on arith by construction: every episode is built from an arith problem in the buckets that
neither the `test` nor the `train` split uses (data/arith.py), so the embedded model never sees a held-out or harvested
problem, whatever the seeds. Solutions are written by arith's own writers (terse attempts with slips, long-hand
checks); this module decides which episodes to make of them and where the hidden check spans go.

Hidden check spans open mostly on hard lines (a carry, a borrow, a two-digit product), where the model is least sure:
the lines it is unsure of are the ones it learnt to check. Slips stay spread evenly over the lines: a base trained
with four in five slips on hard lines scored 29% greedy, against 42% with even slips and the same corpus otherwise
(it learnt to slip where it should check). A refine answer reads the workspace's drafts line by line, checks
long-hand only the lines the drafts disagree on (every line when there is one draft: Sequential Refinement), then
writes the problem's steps again with the wrong lines fixed.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from redumix.data.arith import (
    SPLIT_BUCKET,
    ArithConfig,
    Line,
    Problem,
    attempt_lines,
    is_hard,
    long_hand,
    long_hand_solution,
    problems_in_buckets,
    reflection_text,
    solution_text,
)
from redumix.data.grading import verifier_feedback
from redumix.data.prompts import (
    Message,
    attempt_messages,
    critique_messages,
    format_workspace,
    longhand_messages,
    redo_messages,
    refine_messages,
)
from redumix.data.splits import BUCKETS
from redumix.embedded.vocab import REFLECT_CLOSE, REFLECT_OPEN


@dataclass
class CorpusSpec:
    """How the embedded model's training text is mixed (the `embedded.corpus` config section). Weights are relative;
    rates are per episode or per line. The defaults are the mix the shipped build was built and measured with."""

    mix_solution: float = field(default=0.42, metadata={"help": "Weight of plain terse solutions in the corpus."})
    mix_reflection: float = field(default=0.33, metadata={"help": "Weight of reflection episodes."})
    mix_critique: float = field(default=0.05, metadata={"help": "Weight of self-critique episodes."})
    mix_refine: float = field(default=0.15, metadata={"help": "Weight of PDR and SR refine episodes."})
    mix_longhand: float = field(default=0.05, metadata={"help": "Weight of long-hand solutions (LONGHAND prompt)."})
    slip_rate: float = field(
        default=0.1,
        metadata={"help": "Share of trained terse solutions with a slip (the model stays imperfect)."},
    )
    wrong_attempt_rate: float = field(
        default=0.6, metadata={"help": "Share of reflection, critique and refine attempts with a slip."}
    )
    noisy_feedback_rate: float = field(
        default=0.15,
        metadata={"help": "Reflection episodes whose feedback verdict is wrong (the long-hand check overrules it)."},
    )
    check_span_rate: float = field(
        default=0.1, metadata={"help": "Share of terse solution lines with a hidden <|reflect|> check span."}
    )

    def __post_init__(self) -> None:
        problems = []
        for name in ("slip_rate", "wrong_attempt_rate", "noisy_feedback_rate", "check_span_rate"):
            if not 0 <= getattr(self, name) <= 1:
                problems.append(f"{name} must be in [0, 1], got {getattr(self, name)}")
        mix = list(self.weights.values())
        if min(mix) < 0 or sum(mix) <= 0:
            problems.append(f"mix_* weights must be >= 0 with a positive sum, got {mix}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def weights(self) -> dict[str, float]:
        """Weight per episode kind, in the order of `EPISODES`."""
        return {"solution": self.mix_solution, "reflection": self.mix_reflection, "critique": self.mix_critique,
                "refine": self.mix_refine, "longhand": self.mix_longhand}


@dataclass
class Episode:
    """One training conversation; only the assistant turns listed in `trained` carry loss."""

    kind: str
    messages: list[Message]
    trained: tuple[int, ...]


# --- check spans ----------------------------------------------------------------------------------------------------

HARD_WEIGHT = 4.0  # a hard line is this many times likelier than an easy one to hold a check span


def check_probability(line: Line, rate: float) -> float:
    """Spans sit mostly on hard lines; `rate` stays the share of checked lines on a mix of half hard, half easy."""
    return min(1.0, rate * 2 * (HARD_WEIGHT if is_hard(line.left, line.op, line.right) else 1.0) / (HARD_WEIGHT + 1))


def checked_line(line: Line) -> str:
    """A terse line with a hidden long-hand check between ` = ` and its result (where the reflective gate opens)."""
    span = REFLECT_OPEN + long_hand(line.left, line.op, line.right) + REFLECT_CLOSE
    return f"{line.left} {line.op} {line.right} = {span}{line.result}"


def checked_solution(lines: list[Line], checks: set[int]) -> str:
    """`solution_text` with a check span in each line index in `checks`."""
    text = solution_text(lines).split("\n")
    for index in checks:
        text[index] = checked_line(lines[index])
    return "\n".join(text)


# --- episodes -------------------------------------------------------------------------------------------------------


def _wrong_attempt(problem: Problem, rng: random.Random) -> list[Line]:
    n = len(problem.steps)
    slips = {rng.randrange(n)}
    if n > 2 and rng.random() < 0.15:
        slips.add(rng.randrange(n))
    return attempt_lines(problem, rng, slips)


def _attempt(problem: Problem, rng: random.Random, wrong_rate: float) -> list[Line]:
    return _wrong_attempt(problem, rng) if rng.random() < wrong_rate else attempt_lines(problem, rng)


def solution_episode(problem: Problem, rng: random.Random, spec: CorpusSpec) -> Episode:
    lines = _attempt(problem, rng, spec.slip_rate)
    checks = {i for i, line in enumerate(lines) if line.result == line.right_result
              and rng.random() < check_probability(line, spec.check_span_rate)}
    messages = [*attempt_messages(problem.text()), {"role": "assistant", "content": checked_solution(lines, checks)}]
    return Episode("solution", messages, (1,))


def reflection_episode(problem: Problem, rng: random.Random, spec: CorpusSpec) -> Episode:
    """attempt -> feedback + REFLECT -> long-hand reflection -> REDO -> corrected terse solution. The attempt is
    context only: training on it would teach slips at the rate reflection needs to see them."""
    prompt = problem.text()
    lines = _attempt(problem, rng, spec.wrong_attempt_rate)
    attempt = solution_text(lines)
    feedback = verifier_feedback(attempt, str(problem.answer))
    if rng.random() < spec.noisy_feedback_rate:  # a misleading verdict; the long-hand check must overrule it
        right = lines[-1].result == problem.answer
        feedback = f"Your final answer {lines[-1].result} is {'wrong' if right else 'correct'}."
    reflection = reflection_text(problem, lines)
    messages = redo_messages(prompt, attempt, feedback, reflection)
    messages.append({"role": "assistant", "content": solution_text(attempt_lines(problem, rng))})
    return Episode("reflection", messages, (3, 5))


def critique_episode(problem: Problem, rng: random.Random, spec: CorpusSpec) -> Episode:
    """[x ‖ y1 ‖ CRITIQUE] -> a verdict phrased as the verifier would, so feedback="self" reads like feedback."""
    attempt = solution_text(_attempt(problem, rng, spec.wrong_attempt_rate))
    messages = critique_messages(problem.text(), attempt)
    messages.append({"role": "assistant", "content": verifier_feedback(attempt, str(problem.answer))})
    return Episode("critique", messages, (3,))


def refine_checks(problem: Problem, drafts: list[list[Line]]) -> str:
    """Read the drafts line by line against the problem. A line every draft agrees on, rightly, is kept as it is;
    any other line (every line when there is one draft) is re-derived long-hand and Solution 1's value judged."""
    values = problem.values()
    out = ["I check Solution 1 line by line."]
    for index, step in enumerate(problem.steps):
        a, result = values[index], values[index + 1]
        right = Line(a, step.op, step.operand, result)
        if len(drafts) > 1 and all(d[index] == right for d in drafts):
            out.append(f"Line {index + 1}: {right.text()}. All agree.")
            continue
        check = f"Line {index + 1}: {a} {step.op} {step.operand}: {long_hand(a, step.op, step.operand)}."
        written = drafts[0][index].result
        out.append(f"{check} Right." if written == result else f"{check} Wrong, I wrote {written}.")
    return "\n".join(out)


def refine_answer(problem: Problem, drafts: list[list[Line]], final: list[Line]) -> str:
    """The refine turn: the line checks, then the problem's steps again with the wrong lines fixed (`final`)."""
    return refine_checks(problem, drafts) + "\n" + solution_text(final)


def workspace_order(drafts: list[list[Line]]) -> list[list[Line]]:
    """Drafts as PDR's extract distill orders them: one per distinct answer by descending votes, then the rest,
    identical drafts once."""
    votes = Counter(d[-1].result for d in drafts)
    ranked = sorted(range(len(drafts)), key=lambda i: (-votes[drafts[i][-1].result], i))
    first_of_answer = {}
    for i in ranked:
        first_of_answer.setdefault(drafts[i][-1].result, i)
    order = list(first_of_answer.values()) + [i for i in ranked if i not in first_of_answer.values()]
    unique: list[list[Line]] = []
    for i in order:
        if drafts[i] not in unique:
            unique.append(drafts[i])
    return unique


def refine_episode(problem: Problem, rng: random.Random, spec: CorpusSpec) -> Episode:
    """PDR and SR: a workspace of 1-4 earlier drafts (some wrong) -> line checks -> the steps again, fixed.

    A quarter of the workspaces hold one earlier refine answer instead of terse drafts, as a second PDR or SR round
    sees it (one refine answer fills PDR's default workspace of 192 tokens); its final lines slip as often as
    attempts do.
    """
    if rng.random() < 0.25:
        drafts = [_attempt(problem, rng, spec.wrong_attempt_rate)]
        earlier = [_attempt(problem, rng, spec.wrong_attempt_rate) for _ in range(rng.randint(1, 4))]
        texts = [refine_answer(problem, workspace_order(earlier), drafts[0])]
    else:
        drafts = workspace_order([_attempt(problem, rng, spec.wrong_attempt_rate) for _ in range(rng.randint(1, 4))])
        texts = [solution_text(d) for d in drafts]
    messages = refine_messages(problem.text(), format_workspace(texts))
    messages.append({"role": "assistant", "content": refine_answer(problem, drafts, attempt_lines(problem, rng))})
    return Episode("refine", messages, (1,))


def longhand_episode(problem: Problem, rng: random.Random, spec: CorpusSpec) -> Episode:
    """[x ‖ LONGHAND] -> the whole solution done the careful way (the visible long-hand CoT baseline)."""
    messages = [*longhand_messages(problem.text()), {"role": "assistant", "content": long_hand_solution(problem)}]
    return Episode("longhand", messages, (1,))


EPISODES = {
    "solution": solution_episode,
    "reflection": reflection_episode,
    "critique": critique_episode,
    "refine": refine_episode,
    "longhand": longhand_episode,
}


def corpus_episodes(task: ArithConfig, spec: CorpusSpec, seed: int) -> Iterator[Episode]:
    """An endless, seeded stream of base training episodes on arith problems (of `task`'s difficulty) outside the
    test and train buckets."""
    kinds = [k for k, w in spec.weights.items() if w > 0]
    weights = [spec.weights[k] for k in kinds]
    rng = random.Random(f"arith:corpus:{seed}")
    base_buckets = set(range(BUCKETS)) - set(SPLIT_BUCKET.values())
    for problem in problems_in_buckets(task, base_buckets, "base", seed):
        yield EPISODES[rng.choices(kinds, weights)[0]](problem, rng, spec)
