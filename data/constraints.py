"""`constraints`: short writing requests with instructions a program can check, in the spirit of IFEval (Zhou et al.
2023, "Instruction-Following Evaluation for Large Language Models"). IFEval's data and its nltk resources need
downloads, so the requests and the checkers are written here.

A prompt is one of `TOPICS` ("Write a short note to a neighbour about a lost cat.") followed by 1-3 constraints,
each drawn from a kind of `KINDS`:

| kind | the instruction | holds when |
|---|---|---|
| `lowercase` | all lowercase | no capital letter |
| `uppercase` | all capital letters | no lowercase letter |
| `max_words` | at most N words | words <= N |
| `min_words` | at least N words | words >= N |
| `include_words` | include the word(s) | each appears as a whole word, in any case |
| `avoid_words` | do not use the word(s) | none appears as a whole word, in any case |
| `avoid_letter` | do not use the letter | it does not appear, in either case |
| `start_with` | start with the exact phrase | the answer begins with it (case aside), and no word goes on past it |
| `end_with` | end with the exact phrase | the answer ends with it (case aside), and it does not end inside a word |
| `bullets` | exactly N bullet points | exactly N lines start (after indentation) with `* ` or `- ` |
| `no_commas` | no commas | no `,` |
| `json` | the whole answer in JSON | it parses with `json.loads` as an object or a list (inside a ``` fence too) |
| `title` | a title in `<<...>>` | `<<...>>` with something other than spaces inside, on one line |

**A word** is a whitespace-separated token holding at least one letter or digit: `don't` is one word, and `*`, `-`
or `--` are none. `max_words`, `min_words` and the "no words" rule below count these.

**The answer** is the whole completion, stripped: there is no "The answer is" to find.

**Grading is strict**: a completion is correct when it has a word and every constraint holds (a completion with no
word is never correct, so that an empty reply cannot pass "no commas, at most 20 words"). `sub_scores` gives each
constraint's own verdict under its kind's name; eval's report turns them into a pass rate per kind.

**Feedback** is the verifier's: one sentence per failed constraint, each naming what it found ("The answer has 31
words, but the instruction asks for at most 20."), or "All constraints are met." There is no gold answer to reveal.

**The reference** (`Example.reference`) holds the constraints as JSON (`[{"kind": "max_words", "value": 20}, ...]`):
the harvest grades only examples that have a reference, and grading reads the constraints from it, so a record can
be graded again on its own.

**Splits.** A problem's canonical form is its request with its constraints sorted (their order in the prompt does
not count). It falls into one of ten buckets by a stable hash (data/splits.py, as arith's problems do): bucket 0 is
the `test` split, the other nine the `train` split (no base pre-trains on this task, so nothing is kept back for it).
Both splits use every request; a problem (request and constraints) is in one split only. With
`holdout_requests` N > 0 the request alone decides: the N requests whose text hashes first (`held_out_requests`)
are the test split's, in every bucket, and the train split never draws them.

**No contradictions.** `contradiction` names why a set of constraints could not all hold (lowercase with uppercase,
a word to include or a phrase to write that holds a banned letter or a banned word or, under `no_commas`, a comma,
JSON with a phrase to start or end with or with bullet points, at least M words with at most N < M, or more words
forced by the phrases, the words to include, the bullets and the title than `max_words` allows); a draw it names is
thrown away.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from redumix.data.constraint_checks import (
    TITLE_EXAMPLE,
    _the_words,
    check_avoid_letter,
    check_avoid_words,
    check_bullets,
    check_end_with,
    check_include_words,
    check_json,
    check_lowercase,
    check_max_words,
    check_min_words,
    check_no_commas,
    check_start_with,
    check_title,
    check_uppercase,
    has_word,
    template_reply,
    words,
)
from redumix.data.splits import BUCKETS, bucket, distinct_problems, split_buckets
from redumix.data.task import Example, Split

SPLIT_BUCKETS = {"test": {0}, "train": set(range(1, BUCKETS))}

TOPICS = [
    "Write a short note to a neighbour about a lost cat.",
    "Describe your favourite season.",
    "Write a short story about a robot who learns to paint.",
    "Explain why people should drink enough water.",
    "Write a thank-you message to a teacher.",
    "Describe a busy market on a Saturday morning.",
    "Give advice to someone who is starting to learn the guitar.",
    "Write a product description for a reusable water bottle.",
    "Describe the view from the top of a mountain.",
    "Write a short poem about the sea.",
    "Explain how to make a cup of tea.",
    "Write an invitation to a birthday party.",
    "Describe your ideal weekend.",
    "Write a review of a small local bakery.",
    "Explain why sleep matters for students.",
    "Write a postcard from a holiday by a lake.",
    "Describe a rainy afternoon in a city.",
    "Write a short speech to welcome new members of a chess club.",
    "Explain to a young child what a library is.",
    "Write a message asking a friend to return a book they borrowed.",
    "Describe an old tree in a park.",
    "Give tips for keeping a small vegetable garden.",
    "Write a short story about a lost key.",
    "Explain why people enjoy music.",
    "Write an apology to a friend for missing their call.",
    "Describe a train journey through the countryside.",
    "Write a weather report for a sunny day.",
    "Explain how to plant a seed.",
    "Write a short letter to your future self.",
    "Describe the smell of fresh bread.",
    "Write a notice asking people to keep the office kitchen clean.",
    "Explain why bicycles are good for cities.",
    "Write a short fable about a fox and a crow.",
    "Describe a night sky full of stars.",
    "Write a note to a colleague about a meeting that moved to Friday.",
    "Give reasons to visit a museum.",
    "Write a short diary entry about the first day at a new school.",
    "Describe a friendly dog you met on a walk.",
    "Explain how to stay calm before an exam.",
    "Write an announcement for a school bake sale.",
]
INCLUDE_WORDS = ["blue", "river", "morning", "garden", "window", "light", "music", "paper", "summer", "quiet",
                 "bright", "journey", "simple", "orange", "happy", "friend"]
AVOID_WORDS = ["very", "really", "good", "nice", "thing", "just", "and", "the"]  # none of INCLUDE_WORDS
LETTERS = ["b", "f", "g", "j", "k", "p", "q", "v", "w", "x", "y", "z"]
START_PHRASES = ["Dear friend", "Here is my answer", "Once upon a time", "Hello there", "Good morning",
                 "Let me explain"]
END_PHRASES = ["Any other questions?", "Is there anything else I can help with?", "Thank you for reading.",
               "That is all.", "See you soon!"]


# --- the kinds ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    instruction: Callable[[Any], str]  # the prompt's sentence, from the constraint's value
    check: Callable[[Any, str], str | None]  # None when the text obeys, else what the verifier says
    draw: Callable[[random.Random, ConstraintsConfig], Any]  # the value of a new constraint (None: it takes none)


def _none(rng: random.Random, config: ConstraintsConfig) -> None:
    return None


def _some(pool: list[str]) -> Callable[[random.Random, ConstraintsConfig], tuple[str, ...]]:
    return lambda rng, config: tuple(sorted(rng.sample(pool, rng.randint(1, 2))))


KINDS: dict[str, Kind] = {
    "lowercase": Kind(lambda _: "Your entire answer must be in lowercase letters, with no capital letters at all.",
                      check_lowercase, _none),
    "uppercase": Kind(lambda _: "Your entire answer must be in capital letters.", check_uppercase, _none),
    "max_words": Kind(lambda n: f"Answer in at most {n} words.", check_max_words,
                      lambda rng, config: rng.randint(*config.max_words)),
    "min_words": Kind(lambda n: f"Answer in at least {n} words.", check_min_words,
                      lambda rng, config: rng.randint(*config.min_words)),
    "include_words": Kind(lambda ws: f"Include {_the_words(ws, 'and')}.", check_include_words, _some(INCLUDE_WORDS)),
    "avoid_words": Kind(lambda ws: f"Do not use {_the_words(ws, 'or')}.", check_avoid_words, _some(AVOID_WORDS)),
    "avoid_letter": Kind(lambda c: f'Do not use the letter "{c}" anywhere in your answer.', check_avoid_letter,
                         lambda rng, config: rng.choice(LETTERS)),
    "start_with": Kind(lambda p: f'Start your answer with the exact phrase "{p}".', check_start_with,
                       lambda rng, config: rng.choice(START_PHRASES)),
    "end_with": Kind(lambda p: f'End your answer with the exact phrase "{p}" and write nothing after it.',
                     check_end_with, lambda rng, config: rng.choice(END_PHRASES)),
    "bullets": Kind(lambda n: f'Use exactly {n} bullet points, each on its own line starting with "* ".',
                    check_bullets, lambda rng, config: rng.randint(*config.bullets)),
    "no_commas": Kind(lambda _: "Do not use any commas in your answer.", check_no_commas, _none),
    "json": Kind(lambda _: "Wrap your entire answer in JSON format.", check_json, _none),
    "title": Kind(lambda _: f"Give your answer a title wrapped in double angular brackets, such as {TITLE_EXAMPLE}.",
                  check_title, _none),
}


# --- settings -------------------------------------------------------------------------------------------------------


@dataclass
class ConstraintsConfig:
    """`task.constraints`: how many constraints a prompt carries, of which kinds, with which numbers."""

    constraints_min: int = field(default=1, metadata={"help": "Fewest constraints in a prompt."})
    constraints_max: int = field(default=3, metadata={"help": "Most constraints in a prompt."})
    kinds: list[str] = field(
        default_factory=lambda: list(KINDS),
        metadata={"help": "The kinds of constraint drawn from (KINDS in data/constraints.py), no two alike."},
    )
    max_words: list[int] = field(
        default_factory=lambda: [10, 40],
        metadata={"help": "[low, high]: the N of max_words ('at most N words') is drawn from low..high."},
    )
    min_words: list[int] = field(
        default_factory=lambda: [20, 60],
        metadata={"help": "[low, high]: the N of min_words ('at least N words') is drawn from low..high."},
    )
    bullets: list[int] = field(
        default_factory=lambda: [2, 5],
        metadata={"help": "[low, high]: the N of bullets ('exactly N bullet points') is drawn from low..high."},
    )
    holdout_requests: int = field(
        default=0,
        metadata={"help": f"How many of the {len(TOPICS)} requests only the test split uses (the ones whose text "
                  "hashes first), so that no test prompt shares its request with a train prompt; 0: both splits use "
                  "every request and a problem is in one split only.",
                  "record": "at_default_left_out"},  # 0 draws what came before the key: old fingerprints stand
    )

    def __post_init__(self) -> None:
        problems = []
        unknown = [k for k in self.kinds if k not in KINDS]
        if unknown:
            problems.append(f"unknown kinds {unknown} (known: {', '.join(KINDS)})")
        if len(set(self.kinds)) != len(self.kinds):
            problems.append(f"kinds lists a kind twice: {self.kinds}")
        if not 1 <= self.constraints_min <= self.constraints_max <= len(set(self.kinds)):
            problems.append(f"need 1 <= constraints_min <= constraints_max <= the number of kinds "
                            f"({len(set(self.kinds))}), got {self.constraints_min}, {self.constraints_max}")
        for name in ("max_words", "min_words", "bullets"):
            pair = getattr(self, name)
            if len(pair) != 2 or not 1 <= pair[0] <= pair[1]:
                problems.append(f"{name} must be [low, high] with 1 <= low <= high, got {pair}")
        if not 0 <= self.holdout_requests < len(TOPICS):
            problems.append(f"holdout_requests must be at least 0 and fewer than the {len(TOPICS)} requests (the "
                            f"train split needs some), got {self.holdout_requests}")
        if problems:
            raise ValueError("; ".join(problems))


# --- problems -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Constraint:
    kind: str
    value: Any = None  # an int (max_words, min_words, bullets), a str (letter, phrase), a tuple of words, or None

    def spec(self) -> dict[str, Any]:
        value = list(self.value) if isinstance(self.value, tuple) else self.value
        return {"kind": self.kind} if value is None else {"kind": self.kind, "value": value}

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> Constraint:
        value = spec.get("value")
        return cls(spec["kind"], tuple(value) if isinstance(value, list) else value)

    def instruction(self) -> str:
        return KINDS[self.kind].instruction(self.value)

    def failure(self, text: str) -> str | None:
        """None when `text` obeys this constraint, else the verifier's sentence on what it found."""
        return KINDS[self.kind].check(self.value, text)


@dataclass(frozen=True)
class Problem:
    topic: str
    constraints: tuple[Constraint, ...]  # in the prompt's order

    @property
    def key(self) -> str:
        """The canonical problem: its request and its sorted constraints (their order in the prompt does not count)."""
        specs = sorted(json.dumps(c.spec(), sort_keys=True) for c in self.constraints)
        return json.dumps([self.topic, specs])

    @property
    def bucket(self) -> int:
        return bucket(self.key)

    def text(self) -> str:
        return " ".join([self.topic, *(c.instruction() for c in self.constraints)])

    def reference(self) -> str:
        return json.dumps([c.spec() for c in self.constraints])


def contradiction(constraints: tuple[Constraint, ...] | list[Constraint]) -> str | None:
    """Why no answer could meet every one of `constraints`, or None when one could."""
    by = {c.kind: c.value for c in constraints}
    if "lowercase" in by and "uppercase" in by:
        return "all lowercase and all uppercase"
    if "json" in by and {"start_with", "end_with", "bullets"} & set(by):
        return "JSON cannot start or end with a phrase, or hold lines that start with a bullet"
    if "max_words" in by and "min_words" in by and by["min_words"] > by["max_words"]:
        return f"at least {by['min_words']} words and at most {by['max_words']}"
    forced = [*by.get("include_words", ()), *(by[k] for k in ("start_with", "end_with") if k in by)]
    for text in forced:
        if "avoid_letter" in by and by["avoid_letter"] in text.lower():
            return f'"{text}" must be written, but it holds the banned letter "{by["avoid_letter"]}"'
        banned = [w for w in by.get("avoid_words", ()) if has_word(text, w)]
        if banned:
            return f'"{text}" must be written, but it holds the banned word "{banned[0]}"'
        if "no_commas" in by and "," in text:
            return f'"{text}" must be written, but it holds a comma'
    # Each word to include, each phrase's words, a word per bullet and the title's word must all fit.
    needed = len(words(" ".join(forced))) + by.get("bullets", 0) + ("title" in by)
    if "max_words" in by and needed > by["max_words"]:
        return f"{needed} words are forced, but at most {by['max_words']} are allowed"
    return None


def sample_problem(rng: random.Random, config: ConstraintsConfig) -> Problem:
    """A request and 1-3 constraints of distinct kinds, possibly contradictory (the stream throws those away)."""
    topic = rng.choice(TOPICS)
    kinds = rng.sample(config.kinds, rng.randint(config.constraints_min, config.constraints_max))
    return Problem(topic, tuple(Constraint(kind, KINDS[kind].draw(rng, config)) for kind in kinds))


def held_out_requests(count: int) -> frozenset[str]:
    """The `count` requests of `TOPICS` whose text's SHA-256 comes first: the same in every process and run."""
    return frozenset(sorted(TOPICS, key=lambda topic: hashlib.sha256(topic.encode()).digest())[:count])


def problems_in_split(config: ConstraintsConfig, split: Split, seed: int) -> Iterator[Problem]:
    """An endless, seeded stream of distinct problems with no contradiction whose canonical form hashes into the
    split's buckets; with `holdout_requests`, those of the split's requests instead, in every bucket."""
    held = held_out_requests(config.holdout_requests)
    buckets = set(range(BUCKETS)) if held else split_buckets("constraints", split, SPLIT_BUCKETS)

    def keep(problem: Problem) -> bool:
        return not contradiction(problem.constraints) and (not held or (problem.topic in held) == (split == "test"))

    return distinct_problems("constraints", split, seed, buckets, lambda rng: sample_problem(rng, config),
                             lambda problem: problem.key, "the settings (task.constraints: kinds, "
                             "constraints_min/max, the ranges and holdout_requests)", keep=keep)


def constraint_problems(config: ConstraintsConfig, split: Split, n: int, seed: int) -> list[Problem]:
    stream = problems_in_split(config, split, seed)
    return [next(stream) for _ in range(n)]


# --- grading --------------------------------------------------------------------------------------------------------


def constraints_of(example: Example) -> list[Constraint]:
    return [Constraint.from_spec(spec) for spec in json.loads(example.reference)]


def failures(text: str, example: Example) -> dict[str, str | None]:
    """Each constraint's kind and what the verifier says about it (None when it holds)."""
    return {c.kind: c.failure(text) for c in constraints_of(example)}


class ConstraintsTask:
    """`constraints` through the Task seam: seeded prompts, strict grading, a verifier that names each failure."""

    name = "constraints"

    def __init__(self, config: ConstraintsConfig, seed: int, prompt_suffix: str = "") -> None:
        self.config = config
        self.seed = seed
        self.prompt_suffix = prompt_suffix

    def examples(self, split: Split, n: int | None) -> list[Example]:
        """The first n problems of a split, ids `constraints-{split}-{index:06d}`; a larger n extends the same list."""
        if n is None:
            raise ValueError("task 'constraints' is generated: set how many examples (harvest.n / eval.n)")
        return [Example(id=f"constraints-{split}-{i:06d}", task=self.name, prompt=p.text() + self.prompt_suffix,
                        reference=p.reference())
                for i, p in enumerate(constraint_problems(self.config, split, n, self.seed))]

    def solutions(self, split: Split, n: int) -> dict[str, str]:
        """Empty: a request has many right answers and no reference working (`train.target=gold` says so)."""
        return {}

    @staticmethod
    def answer(text: str) -> str | None:
        return text.strip() or None

    @staticmethod
    def sub_scores(text: str, example: Example) -> dict[str, bool]:
        """Each constraint's verdict, by kind (a completion with no word fails them all)."""
        found = failures(text, example)
        return {kind: bool(words(text)) and failure is None for kind, failure in found.items()}

    @staticmethod
    def is_correct(text: str, example: Example) -> bool:
        return all(ConstraintsTask.sub_scores(text, example).values())

    @staticmethod
    def blind_replies(example: Example) -> dict[str, str]:
        """Replies that answer no request, by name (constraint_checks.template_reply): eval's report grades them on its
        test examples as baselines."""
        values = {c.kind: c.value for c in constraints_of(example)}
        return {"template reply (no topic)": template_reply(values), "`ok` alone": "ok"}

    @staticmethod
    def feedback(text: str, example: Example) -> str:
        if not words(text):
            return "The answer has no words."
        said = [failure for failure in failures(text, example).values() if failure is not None]
        return " ".join(said) if said else "All constraints are met."
