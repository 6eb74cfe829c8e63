"""Cautious Next Token Prediction (CNTP; Wang et al., "Cautious Next Token Prediction", Findings of ACL 2025,
arXiv 2507.03038, github.com/wyzjack/CNTP).

At each step the decoder measures the entropy H of the model's next-token distribution. Where the model is sure
(H below `entropy_low`) it decodes one token as plain decoding would. Where it is unsure it samples k trials from
this point independently, each running until it emits a punctuation token, and keeps the trial with the lowest
perplexity (mean NLL per token under the model). The number of trials grows linearly with entropy, as in the public
code: k = 1 + floor((max_trials − 1) · clamp((H − entropy_low) / (entropy_high − entropy_low), 0, 1)), so k = 1 (no
branch) below `entropy_low` and k = `max_trials` at or above `entropy_high`.

What differs from the public code, and why:
- Batched: the public code runs one sequence and its trials one after another. Here every example of the batch
  and every trial of every branching example is a row of one batch, and each step is one forward pass. An example
  that branches forks into k rows (their caches copied from its row); when all its trials have ended, the winning
  row carries on as the example's row and the others are dropped. Other examples keep decoding meanwhile, so a
  branch in one example never stalls the rest. A trial that has ended waits, unfed, for its siblings; its
  position is masked, so FPE counts only positions the model actually processed.
- Entropy and perplexity use the model's own distribution (temperature 1, no top-k/top-p), so that the branch
  rule and the choice among trials do not move with the decoding policy. The public code takes both from its
  processed distribution (after the temperature and top-p warpers) and samples trials from it too; its scripts
  decode at temperature 0.6-1.2 with top-p 0.95. Under a greedy policy (no warpers) and `trial_temperature` 1, the
  two agree; closer to the paper's sampled runs is `trial_temperature` equal to the policy's temperature.
- Trials sample at `trial_temperature` with the policy's top-k/top-p. The step's own token is never a trial: at a
  branch, all k continuations are sampled, as in the public code.
- A trial also ends at a per-trial cap (`trial_max_tokens`) and at the answer's remaining token budget; the public
  code has only the global length limit. A token ends a trial when its decoded text contains any `punctuation`
  character; the public code compares ids with the single-character encodings of ". , \\n ? ! : ; ) ] }", which
  misses merged tokens such as " 5." of a BPE vocabulary.
- Noise is counter-based, as in every decoder here: the example's own stream indexed by its visible position, and
  for trial t at a branch at position p a stream seeded by (example seed, p, t), indexed by the trial's token
  count. With nothing branching (k = 1 everywhere) CNTP therefore equals plain decoding token for token.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from redumix.data.chat import decode_text
from redumix.data.task import Example, Task
from redumix.generate.accounting import Usage
from redumix.generate.decoder import Decoded, attempt_prompts, example_seeds
from redumix.generate.engine import Engine
from redumix.generate.hf_engine import hf_parts
from redumix.generate.loop import Generation, should_compact
from redumix.generate.model_io import stop_token_ids
from redumix.generate.policy import SamplingPolicy, example_seed, policy_logprobs, sample_tokens
from redumix.generate.state import forward, prefill, select


@dataclass
class CntpConfig:
    max_trials: int = field(default=10, metadata={"help": "Most trials at one branch point (1 never branches)."})
    entropy_low: float = field(
        default=0.01, metadata={"help": "Entropy (nats) below which a step decodes one token without trials."}
    )
    entropy_high: float = field(
        default=1.5, metadata={"help": "Entropy (nats) at and above which a branch samples max_trials trials."}
    )
    trial_temperature: float = field(
        default=1.0, metadata={"help": "Temperature trials sample at (the policy's top-k/top-p also apply)."}
    )
    trial_max_tokens: int = field(
        default=32, metadata={"help": "Most tokens in one trial, for stretches with no punctuation."}
    )
    punctuation: str = field(
        default=".,;:!?)]}\n", metadata={"help": "Characters that end a trial: any token whose text holds one."}
    )

    def __post_init__(self) -> None:
        problems = []
        if self.max_trials < 1:
            problems.append(f"max_trials must be >= 1, got {self.max_trials}")
        if self.entropy_low < 0:
            problems.append(f"entropy_low must be >= 0, got {self.entropy_low}")
        if self.entropy_high <= self.entropy_low:
            problems.append(f"entropy_high must be > entropy_low, got {self.entropy_high} <= {self.entropy_low}")
        if self.trial_temperature <= 0:
            problems.append(f"trial_temperature must be > 0 (greedy trials would all agree), got "
                            f"{self.trial_temperature}")
        if self.trial_max_tokens < 1:
            problems.append(f"trial_max_tokens must be >= 1, got {self.trial_max_tokens}")
        if not self.punctuation:
            problems.append("punctuation must name at least one character")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class Branch:
    """One branch point of an example: the trials sampled there and the one kept."""

    position: int  # visible tokens emitted before the branch
    entropy: float  # of the model's next-token distribution there, in nats
    trials: list[list[int]]  # each trial's token ids, its ending token included
    mean_nll: list[float]  # each trial's mean −log p(token) under the model: log perplexity
    kept: int  # the trial with the lowest perplexity (the first on a tie); it follows `position` in the output


@dataclass
class CntpResult:
    generation: Generation  # the visible answer and the example's accounting, trials included
    branches: list[Branch]


# --- trial counts and punctuation -----------------------------------------------------------------------------------


def trial_counts(entropy: torch.Tensor, config: CntpConfig) -> torch.Tensor:
    """Trials per row [B] long for entropies [B]: 1 below entropy_low, max_trials from entropy_high, linear between."""
    scaled = ((entropy - config.entropy_low) / (config.entropy_high - config.entropy_low)).clamp(0, 1)
    return 1 + ((config.max_trials - 1) * scaled).floor().long()


def entropy_nats(logprobs: torch.Tensor) -> torch.Tensor:
    """Entropy [B] of log-probs [B, V]; 0·log 0 counts as 0."""
    return -torch.where(logprobs > float("-inf"), logprobs.exp() * logprobs, 0.0).sum(dim=-1)


@functools.lru_cache(maxsize=4)
def punctuation_mask(tokenizer: PreTrainedTokenizerBase, punctuation: str, vocab_size: int) -> torch.Tensor:
    """[V] bool: the ids whose decoded text holds a punctuation character (special tokens decode to "" and never do).

    Cached per tokenizer, since decoding a large vocabulary id by id takes a while.
    """
    size = min(len(tokenizer), vocab_size)  # ids the model has but the tokenizer lacks are never punctuation
    texts = tokenizer.batch_decode([[i] for i in range(size)], skip_special_tokens=True)
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[:size] = torch.tensor([any(ch in text for ch in punctuation) for text in texts], dtype=torch.bool)
    return mask


# --- rows -----------------------------------------------------------------------------------------------------------


@dataclass
class _Trial:
    seed: int
    cap: int  # tokens it may take: trial_max_tokens or what is left of the answer's budget, if less
    tokens: list[int] = field(default_factory=list)
    nll: float = 0.0  # summed −log p of its tokens
    ended: bool = False

    @property
    def mean_nll(self) -> float:
        return self.nll / len(self.tokens)


@dataclass
class _Row:
    """One batch row: an example's own row (trial None) or one of its trials."""

    example: int
    trial: _Trial | None = None
    dead: bool = False  # finished example or losing trial, waiting to be compacted out

    @property
    def samples(self) -> bool:
        return not self.dead and not (self.trial is not None and self.trial.ended)


@dataclass
class _Example:
    seed: int
    tokens: list[int] = field(default_factory=list)  # the visible answer so far
    branches: list[Branch] = field(default_factory=list)
    open_branch: tuple[int, float, list[_Trial]] | None = None  # (position, entropy, trials) while trials run
    generated: int = 0
    fpe: int = 0
    finished: bool = False  # ended on a stop token
    done: bool = False


def _fork(rows: list[_Row], counts: list[int], entropy: list[float], examples: list[_Example],
          config: CntpConfig, max_new_tokens: int) -> tuple[list[_Row], list[int]]:
    """Rows after forking each example row whose trial count is above 1, and the old row each new one copies."""
    new_rows, source = [], []
    for r, row in enumerate(rows):
        if row.trial is not None or row.dead or counts[r] == 1:
            new_rows.append(row)
            source.append(r)
            continue
        ex = examples[row.example]
        position = len(ex.tokens)
        cap = min(config.trial_max_tokens, max_new_tokens - position)
        trials = [_Trial(example_seed(ex.seed, f"cntp/{position}/{t}"), cap) for t in range(counts[r])]
        ex.open_branch = (position, entropy[r], trials)
        new_rows += [_Row(row.example, trial) for trial in trials]
        source += [r] * len(trials)
    return new_rows, source


def _sample(rows: list[_Row], examples: list[_Example], logits: torch.Tensor, policy: SamplingPolicy,
            trial_policy: SamplingPolicy) -> torch.Tensor:
    """A token for every row that samples this step (others get 0): example rows by the policy, with the example's
    noise at its visible position; trial rows at the trial policy, with the trial's noise at its own position."""
    tokens = torch.zeros(len(rows), dtype=torch.long, device=logits.device)
    for is_trial, pol in ((False, policy), (True, trial_policy)):
        idx = [r for r, row in enumerate(rows) if row.samples and (row.trial is not None) == is_trial]
        if not idx:
            continue
        # A trial row draws with the trial's noise at its own position, an example row with the example's.
        owners = [rows[r].trial or examples[rows[r].example] for r in idx]
        seeds = [owner.seed for owner in owners]
        steps = [len(owner.tokens) for owner in owners]
        idx_t = torch.as_tensor(idx, device=logits.device)
        as_tensor = functools.partial(torch.as_tensor, dtype=torch.long, device=logits.device)
        # Greedy takes the argmax of the raw logits, exactly as plain decoding does.
        scores = logits[idx_t] if pol.greedy else policy_logprobs(logits[idx_t], pol)
        tokens[idx_t] = sample_tokens(scores, pol, as_tensor(seeds), as_tensor(steps))
    return tokens


def _resolve(ex: _Example, stop_ids: set[int], max_new_tokens: int) -> _Trial:
    """Close the example's open branch: keep its lowest-perplexity trial and append it to the answer."""
    position, entropy, trials = ex.open_branch
    kept = min(range(len(trials)), key=lambda t: trials[t].mean_nll)
    ex.branches.append(Branch(position, entropy, [t.tokens for t in trials], [t.mean_nll for t in trials], kept))
    ex.tokens += trials[kept].tokens
    ex.open_branch = None
    ex.finished = trials[kept].tokens[-1] in stop_ids
    ex.done = ex.finished or len(ex.tokens) >= max_new_tokens
    return trials[kept]


def _advance(rows: list[_Row], tokens: list[int], nll: list[float], examples: list[_Example], punct: list[bool],
             stop_ids: set[int], max_new_tokens: int) -> list[bool]:
    """Record this step's tokens and close the branches whose trials have all ended; which rows to feed."""
    feed = [False] * len(rows)
    for r, row in enumerate(rows):
        if not row.samples:
            continue
        ex, token = examples[row.example], tokens[r]
        ex.generated += 1
        if row.trial is None:
            ex.tokens.append(token)
            ex.finished = token in stop_ids
            ex.done = row.dead = ex.finished or len(ex.tokens) >= max_new_tokens
        else:
            trial = row.trial
            trial.tokens.append(token)
            trial.nll += nll[r]
            trial.ended = punct[token] or token in stop_ids or len(trial.tokens) >= trial.cap
        feed[r] = row.samples
    for i, ex in enumerate(examples):
        if ex.open_branch is None or not all(t.ended for t in ex.open_branch[2]):
            continue
        kept = _resolve(ex, stop_ids, max_new_tokens)
        for r, row in enumerate(rows):
            if row.example != i or row.dead:
                continue
            if row.trial is kept and not ex.done:
                row.trial = None  # the kept trial's row carries on as the example's row, fed its last token
                tokens[r], feed[r] = kept.tokens[-1], True
            else:
                row.dead = True
    return feed


# --- the decoder --------------------------------------------------------------------------------------------------


@torch.inference_mode()
def cntp_generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[int]],
    policy: SamplingPolicy,
    seeds: Sequence[int],
    stop_ids: Sequence[int],
    config: CntpConfig,
) -> list[CntpResult]:
    """CNTP over a batch of prompt ids, one result per prompt; `policy.max_new_tokens` caps each visible answer."""
    max_new = policy.max_new_tokens
    trial_policy = replace(policy, temperature=config.trial_temperature)
    stops = set(stop_ids)
    state = prefill(model, prompts, tokenizer.pad_token_id)
    device = state.attention_mask.device
    punct = punctuation_mask(tokenizer, config.punctuation, state.last_logits.shape[-1]).tolist()
    examples = [_Example(seed, fpe=len(p)) for seed, p in zip(seeds, prompts, strict=True)]
    rows = [_Row(i) for i in range(len(prompts))]
    while True:
        logprobs = torch.log_softmax(state.last_logits.float(), dim=-1)  # the model's own: entropy and NLL
        entropy = entropy_nats(logprobs)
        rows, source = _fork(rows, trial_counts(entropy, config).tolist(), entropy.tolist(), examples, config, max_new)
        forked = len(source) > state.batch_size
        source_t = torch.as_tensor(source, device=device)
        tokens = _sample(rows, examples, state.last_logits[source_t], policy, trial_policy)
        nll = -logprobs[source_t].gather(1, tokens[:, None]).squeeze(1)
        token_list = tokens.tolist()
        feed = _advance(rows, token_list, nll.tolist(), examples, punct, stops, max_new)
        if all(ex.done for ex in examples):
            break
        dead = sum(row.dead for row in rows)
        if forked or should_compact(dead, len(rows)):
            # One copy of the cache does both: clone the forked rows, drop the finished ones.
            keep = [r for r, row in enumerate(rows) if not row.dead]
            state = select(state, [source[r] for r in keep])
            rows, token_list, feed = [rows[r] for r in keep], [token_list[r] for r in keep], [feed[r] for r in keep]
        mask = torch.as_tensor(feed, dtype=torch.long, device=device)[:, None]
        state = forward(model, state, mask, input_ids=torch.as_tensor(token_list, device=device)[:, None])
        for row, fed in zip(rows, feed, strict=True):
            examples[row.example].fpe += fed
    return [_result(ex, len(p)) for ex, p in zip(examples, prompts, strict=True)]


def _result(ex: _Example, prompt_tokens: int) -> CntpResult:
    usage = Usage(visible_tokens=len(ex.tokens), generated_tokens=ex.generated, prefill_tokens=prompt_tokens,
                  fpe=ex.fpe)
    return CntpResult(Generation(ex.tokens, ex.finished, max(len(ex.tokens) - 1, 0), usage), ex.branches)


@dataclass
class CntpDecoder:
    """`cntp`: the model answers x directly, branching into trials where it is unsure."""

    name: str
    config: CntpConfig
    policy: SamplingPolicy
    seed: int

    needs_hf_engine = True  # it chooses tokens from the model's hidden states, step by step

    def __call__(self, engine: Engine, examples: Sequence[Example], task: Task) -> list[Decoded]:
        model, tokenizer = hf_parts(engine)
        stop_ids = stop_token_ids(model, tokenizer)
        results = cntp_generate(model, tokenizer, attempt_prompts(tokenizer, examples), self.policy,
                                example_seeds(self.seed, examples, self.name), stop_ids, self.config)
        return [
            Decoded(decode_text(tokenizer, r.generation.content_ids(stop_ids)),
                    r.generation.token_ids, r.generation.usage,
                    {"trial_steps": len(r.branches), "trials": sum(len(b.trials) for b in r.branches)})
            for r in results
        ]
