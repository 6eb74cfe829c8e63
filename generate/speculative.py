"""Speculative Thinking ("Speculative Thinking: Enhancing Small-Model Reasoning with Large Model Guidance at
Inference Time", 2025; the first entry of ../shared/seeds/related-papers.txt): a larger guide model writes the
reflective steps of a smaller model's answer.

The small model (the checkpoint under eval) decodes greedily. At a delimiter point, where the answer so far ends
with one of `delimiters` (a blank line in chat models; a new line or ` = ` in the embedded world), the decoder looks
at what the small model would write next. If that opening is reflective (its argmax token matches one of
`triggers`, such as "Wait" or `<|reflect|>`) or the small model is unsure there (top-1 probability below
`uncertainty`), the guide writes that step: greedily, up to the next delimiter (the token that makes the text end
with one is the step's last), a stop token or `max_guide_tokens`. Then the small model continues from the guide's
text. Nothing is trained; the two models need the same tokenizer.

The rules, precisely:
- A delimiter point is a step boundary inside the answer: the decoded answer so far (special tokens kept, so
  `<|/reflect|>` can be a delimiter) ends with a delimiter, right after either model wrote that token. The start of
  the answer is not one.
- Trigger words: the small model's argmax token is decoded alone and stripped of surrounding whitespace; it fires
  when that text is non-empty and is a prefix of a stripped trigger (`Wa` of `Wait`) or starts with one (`Wait,`).
  One token is all the decoder looks at, so a trigger of several words fires on its first token.
- Uncertainty: the small model's own top-1 probability (temperature 1, no truncation) below `uncertainty`.
- The ablation (`random_rate` set): the rules are ignored and each delimiter point hands over with probability
  `random_rate`, drawn from the example's own noise stream at its position, so a row's draws never depend on its
  batch. `speculative-random` sets the rate to `speculative-thinking`'s handovers per delimiter point.

Batched, with both models' caches kept (lazy catch-up). Each row keeps, for each model, how many of its answer
tokens that model's cache holds; what the other model wrote since is that model's pending text. A round of the loop
runs at most one forward per model: the small model's forward feeds the pending text of the rows it must write or
judge for, the guide's that of the rows in a guide step. The guide joins a row lazily: the first handover prefills
its prompt and the whole answer so far, and the new rows are merged into the guide's batch. Finished rows leave
both batches. FPE counts every position each model processes (the catch-up of the other's text included), per
model in `extra` (`fpe_small`, `fpe_guide`) and summed in `Usage.fpe`; `ForwardCounter` on each model agrees.

Choices of this implementation (the paper's summary fixes neither):
- Both models run in one process, each keeping its KV cache across handovers, so a handover costs only the text
  the other model wrote since, not a fresh prefill of the whole answer.
- Greedy only: both models take their argmax (eval compares decoders at temperature 0), and the look-ahead is the
  small model's one next token, so deciding a handover costs no extra forward.
- A step the guide writes is capped at `max_guide_tokens`, so a guide that never writes a delimiter cannot take
  over the rest of the answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from redumix.data.chat import decode_text
from redumix.data.task import Example, Task
from redumix.generate.accounting import Usage
from redumix.generate.decoder import Decoded, attempt_prompts, example_seeds
from redumix.generate.engine import Engine
from redumix.generate.hf_engine import HfEngine, hf_parts
from redumix.generate.loop import should_compact
from redumix.generate.model_io import DTYPES, ModelConfig, load_tokenizer, load_weights, stop_token_ids, to_device
from redumix.generate.plain import PlainDecoder
from redumix.generate.policy import SamplingPolicy, uniform_noise
from redumix.generate.state import COMPILED_FORWARD, DecodeState, extend, merge, prefill, select, use_compiled_decoding
from redumix.generate.tail_text import text_ends_with


@dataclass
class SpeculativeConfig:
    guide_path: str | None = field(
        default=None,
        metadata={"help": "The guide model: a local Hugging Face folder with the same tokenizer as the model, larger "
                  "than it. A relative path missing from the working directory is read from the repository "
                  "(models/...). speculative-thinking, speculative-random and guide-greedy need it."},
    )
    delimiters: list[str] = field(
        default_factory=lambda: ["\n\n"],
        metadata={"help": "A new step begins where the answer so far ends with one of these (chat models: a blank "
                  "line). Only there may the guide take over, and its step ends at the next one."},
    )
    triggers: list[str] = field(
        default_factory=lambda: ["Wait", "Hmm", "Alternatively"],
        metadata={"help": "Openings that hand a step to the guide: the small model's next token (decoded, stripped) "
                  "is a prefix of one or starts with one. Special tokens count (e.g. '<|reflect|>')."},
    )
    uncertainty: float = field(
        default=0.0,
        metadata={"help": "Also hand over where the small model's top-1 probability is below this (0 never, 1 at "
                  "every delimiter)."},
    )
    max_guide_tokens: int = field(
        default=128, metadata={"help": "Most tokens the guide writes in one step (it ends at a delimiter before)."}
    )
    random_rate: float | None = field(
        default=None,
        metadata={"help": "The ablation: hand over at each delimiter point with this probability instead of by the "
                  "rules; null uses the rules. speculative-random sets it to speculative-thinking's rate."},
    )

    def __post_init__(self) -> None:
        problems = []
        if self.guide_path is not None and not self.guide_path.strip():
            problems.append("guide_path must name a folder (or be null)")
        if not self.delimiters or any(not isinstance(d, str) or not d for d in self.delimiters):
            problems.append(f"delimiters must hold at least one non-empty string, got {self.delimiters!r}")
        if any(not isinstance(t, str) or not t.strip() for t in self.triggers):
            problems.append(f"triggers must be strings with more than whitespace, got {self.triggers!r}")
        if not 0 <= self.uncertainty <= 1:
            problems.append(f"uncertainty must be in [0, 1], got {self.uncertainty}")
        if self.max_guide_tokens < 1:
            problems.append(f"max_guide_tokens must be >= 1, got {self.max_guide_tokens}")
        if self.random_rate is not None and not 0 <= self.random_rate <= 1:
            problems.append(f"random_rate must be in [0, 1] or null, got {self.random_rate}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class SpeculativeResult:
    token_ids: list[int]  # the answer as written, the stop token included when it ended on one
    finished: bool  # ended on a stop token
    usage: Usage  # fpe: both models together
    fpe_small: int = 0
    fpe_guide: int = 0
    tokens_guide: int = 0  # answer tokens the guide wrote (the rest the small model did)
    guide_steps: int = 0  # handovers
    delimiter_points: int = 0  # points where a handover could happen

    def extra(self) -> dict[str, int | float]:
        visible = len(self.token_ids)
        return {"fpe_small": self.fpe_small, "fpe_guide": self.fpe_guide, "tokens_small": visible - self.tokens_guide,
                "tokens_guide": self.tokens_guide, "guide_steps": self.guide_steps,
                "delimiter_points": self.delimiter_points, "guide_share": self.tokens_guide / max(1, visible)}


# --- delimiters and triggers ----------------------------------------------------------------------------------------


def ends_with_delimiter(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], delimiters: Sequence[str]) -> bool:
    """Whether the decoded `ids` (special tokens kept) end with one of `delimiters`; never for no ids."""
    return bool(ids) and text_ends_with(tokenizer, ids, delimiters, skip_special_tokens=False)


def opens_with_trigger(token_text: str, triggers: Sequence[str]) -> bool:
    """Whether a token's text opens one of `triggers`: stripped, it is non-empty and a prefix of a stripped
    trigger, or it starts with one."""
    text = token_text.strip()
    return bool(text) and any(t.strip().startswith(text) or text.startswith(t.strip()) for t in triggers)


def handover_noise(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """U(0,1) [B] per (example seed, answer position) for the random ablation's handovers: a stream of its own, apart
    from anything else drawn from the example's seed."""
    stream = (seeds.long() * 0x9E3779B1 + 0x5F356495) & ((1 << 31) - 1)
    return uniform_noise(stream, positions, 1)[:, 0]


# --- a row ---------------------------------------------------------------------------------------------------------

SMALL, GUIDE = "small", "guide"  # the two models' roles


@dataclass
class _Row:
    """One example: its answer, and for each model how much of it that model's cache holds and what it cost."""

    prompt: list[int]
    seed: int
    tokens: list[int] = field(default_factory=list)
    seen: dict[str, int | None] = field(default_factory=lambda: {SMALL: 0, GUIDE: None})  # None: not joined yet
    fpe: dict[str, int] = field(default_factory=lambda: {SMALL: 0, GUIDE: 0})
    prefill: int = 0  # prompt positions, in every model that read the prompt
    guide_step: int | None = None  # tokens of the guide's step in progress; None while the small model writes
    at_point: bool = False  # the answer so far ends with a delimiter
    tokens_guide: int = 0
    guide_steps: int = 0
    delimiter_points: int = 0
    done: bool = False

    def result(self, stops: set[int]) -> SpeculativeResult:
        visible = len(self.tokens)
        usage = Usage(visible_tokens=visible, generated_tokens=visible, prefill_tokens=self.prefill,
                      fpe=self.fpe[SMALL] + self.fpe[GUIDE])
        return SpeculativeResult(self.tokens, bool(self.tokens) and self.tokens[-1] in stops, usage, self.fpe[SMALL],
                                 self.fpe[GUIDE], self.tokens_guide, self.guide_steps, self.delimiter_points)


@dataclass
class _Batch:
    """One model's cache over some rows: `rows[b]` is the example in batch row b."""

    role: str  # SMALL or GUIDE
    model: PreTrainedModel
    pad_id: int
    state: DecodeState | None = None
    rows: list[int] = field(default_factory=list)


# --- the loop -------------------------------------------------------------------------------------------------------


@torch.inference_mode()
def speculative_generate(
    small: PreTrainedModel,
    guide: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[int]],
    seeds: Sequence[int],
    stop_ids: Sequence[int],
    config: SpeculativeConfig,
    max_new_tokens: int,
) -> list[SpeculativeResult]:
    """Greedy Speculative Thinking over a batch of prompt ids: one result per prompt, in order. Each round, the
    rows the small model writes for take one token from it (or hand over), then the rows in a guide step take one
    from the guide."""
    pad, stops = tokenizer.pad_token_id, set(stop_ids)
    rows = [_Row(list(p), int(s)) for p, s in zip(prompts, seeds, strict=True)]
    small_batch = _Batch(SMALL, small, pad, prefill(small, prompts, pad), list(range(len(rows))))
    for row in rows:
        row.fpe[SMALL] = row.prefill = len(row.prompt)
    guide_batch = _Batch(GUIDE, guide, pad)
    while not all(row.done for row in rows):
        writers = [i for i, row in enumerate(rows) if not row.done and row.guide_step is None]
        if writers:
            _small_turn(small_batch, rows, writers, tokenizer, config, stops, max_new_tokens)
        steps = [i for i, row in enumerate(rows) if not row.done and row.guide_step is not None]
        if steps:
            _guide_turn(guide_batch, rows, steps, tokenizer, config, stops, max_new_tokens)
        for batch in (small_batch, guide_batch):
            _compact(batch, rows)
    return [row.result(stops) for row in rows]


def _small_turn(batch: _Batch, rows: list[_Row], writers: list[int], tokenizer: PreTrainedTokenizerBase,
                config: SpeculativeConfig, stops: set[int], max_new_tokens: int) -> None:
    """The small model catches up on the writers' rows; then each writes its argmax or, at a delimiter point where
    the trigger fires, hands the step to the guide."""
    logits = _catch_up(batch, rows, writers)
    best = logits.argmax(dim=-1)
    top_p = torch.softmax(logits, dim=-1).gather(1, best[:, None])[:, 0].tolist()
    seeds = torch.as_tensor([rows[i].seed for i in writers])
    noise = handover_noise(seeds, torch.as_tensor([len(rows[i].tokens) for i in writers])).tolist()
    for j, (i, token) in enumerate(zip(writers, best.tolist(), strict=True)):
        row = rows[i]
        if row.at_point:
            row.delimiter_points += 1
            if _hands_over(decode_text(tokenizer, [token], skip_special_tokens=False), top_p[j], noise[j], config):
                row.guide_steps += 1
                row.guide_step = 0
                continue
        _write(row, token, tokenizer, config, stops, max_new_tokens)


def _hands_over(token_text: str, top_p: float, noise: float, config: SpeculativeConfig) -> bool:
    if config.random_rate is not None:
        return noise < config.random_rate
    return opens_with_trigger(token_text, config.triggers) or top_p < config.uncertainty


def _guide_turn(batch: _Batch, rows: list[_Row], steps: list[int], tokenizer: PreTrainedTokenizerBase,
                config: SpeculativeConfig, stops: set[int], max_new_tokens: int) -> None:
    """The guide joins the rows it has not read yet, catches up on the others, and writes one token of each step;
    a step ends at a delimiter, a stop token, the answer's length limit or `max_guide_tokens`."""
    joined = [i for i in steps if rows[i].seen[GUIDE] is not None]
    joining = [i for i in steps if rows[i].seen[GUIDE] is None]
    logits = dict(zip(joined, _catch_up(batch, rows, joined), strict=True))
    if joining:
        logits.update(zip(joining, _join(batch, rows, joining), strict=True))
    for i in steps:
        row = rows[i]
        _write(row, int(logits[i].argmax()), tokenizer, config, stops, max_new_tokens)
        row.tokens_guide += 1
        row.guide_step += 1
        if row.done or row.at_point or row.guide_step >= config.max_guide_tokens:
            row.guide_step = None


def _catch_up(batch: _Batch, rows: list[_Row], wanted: list[int]) -> torch.Tensor:
    """Feed the model each wanted row's pending answer tokens (those its cache lacks), in one forward over its batch
    where the other rows get an empty segment; the next-token logits [len(wanted), V] of the wanted rows."""
    if not wanted:
        return torch.empty(0)
    state = batch.state
    assert state is not None, "the rows to catch up are in the batch, so it has a cache"
    role, wanted_set = batch.role, set(wanted)
    segments = [rows[i].tokens[rows[i].seen[role]:] if i in wanted_set else [] for i in batch.rows]
    if any(segments):
        state = batch.state = extend(batch.model, state, segments, batch.pad_id)
        for i, segment in zip(batch.rows, segments, strict=True):
            rows[i].seen[role] += len(segment)
            rows[i].fpe[role] += len(segment)
    where = {example: b for b, example in enumerate(batch.rows)}
    return state.last_logits[torch.as_tensor([where[i] for i in wanted], device=state.lengths.device)]


def _join(batch: _Batch, rows: list[_Row], joining: list[int]) -> torch.Tensor:
    """Prefill the model with each joining row's prompt and answer so far, add the rows to its batch, and return
    their next-token logits."""
    contexts = [rows[i].prompt + rows[i].tokens for i in joining]
    state = prefill(batch.model, contexts, batch.pad_id)
    for i, context in zip(joining, contexts, strict=True):
        rows[i].seen[batch.role] = len(rows[i].tokens)
        rows[i].fpe[batch.role] += len(context)
        rows[i].prefill += len(rows[i].prompt)
    batch.state = state if batch.state is None else merge([batch.state, state])
    batch.rows = batch.rows + joining
    return state.last_logits


def _write(row: _Row, token: int, tokenizer: PreTrainedTokenizerBase, config: SpeculativeConfig, stops: set[int],
           max_new_tokens: int) -> None:
    row.tokens.append(token)
    row.done = token in stops or len(row.tokens) >= max_new_tokens
    row.at_point = not row.done and ends_with_delimiter(tokenizer, row.tokens, config.delimiters)


def _compact(batch: _Batch, rows: list[_Row]) -> None:
    """Drop finished rows from the model's batch once a quarter of it is done (each compaction copies the cache)."""
    done = sum(rows[i].done for i in batch.rows)
    if batch.state is None or not should_compact(done, len(batch.rows)):
        return
    keep = [b for b, i in enumerate(batch.rows) if not rows[i].done]
    batch.state = select(batch.state, keep) if keep else None
    batch.rows = [batch.rows[b] for b in keep]


# --- the guide model ------------------------------------------------------------------------------------------------

_GUIDES: dict[tuple[str, str, str, str], PreTrainedModel] = {}  # (folder, identity, device, dtype) -> guide


def load_guide(path: str | Path, identity: str, like: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
               trust_remote_code: bool = False) -> PreTrainedModel:
    """The guide in `path`, on `like`'s device and in its dtype, loaded once per process (`identity` changes when
    its weights do). Its tokenizer must be the small model's: the two write into one text."""
    key = (str(path), identity, str(like.device), str(like.dtype))
    if key not in _GUIDES:
        if load_tokenizer(path, trust_remote_code).get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"speculative.guide_path={path}: the guide's tokenizer is not the model's "
                             f"({tokenizer.name_or_path}); the guide must share the model's vocabulary")
        dtype = {v: k for k, v in DTYPES.items()}.get(like.dtype, "float32")
        guide = load_weights(path, ModelConfig(dtype=dtype, trust_remote_code=trust_remote_code))
        to_device(guide, like.device).eval()
        if hasattr(like, COMPILED_FORWARD):
            use_compiled_decoding(guide)
        _GUIDES[key] = guide
    return _GUIDES[key]


# --- the decoders ---------------------------------------------------------------------------------------------------


@dataclass
class SpeculativeDecoder:
    """`speculative-thinking` (and, with `config.random_rate` set, `speculative-random`): the model writes, the
    guide in `guide` writes the steps the trigger hands it."""

    name: str
    config: SpeculativeConfig
    policy: SamplingPolicy  # only max_new_tokens: both models decode greedily
    seed: int
    guide: str  # the guide's folder, resolved
    guide_identity: str  # changes when the guide's weights do, so that its records are redone
    trust_remote_code: bool = False

    needs_hf_engine = True  # two models hand one cache between them, token by token

    def __call__(self, engine: Engine, examples: Sequence[Example], task: Task) -> list[Decoded]:
        model, tokenizer = hf_parts(engine)
        guide = load_guide(self.guide, self.guide_identity, model, tokenizer, self.trust_remote_code)
        stop_ids = sorted(set(stop_token_ids(model, tokenizer)) | set(stop_token_ids(guide, tokenizer)))
        results = speculative_generate(model, guide, tokenizer, attempt_prompts(tokenizer, examples),
                                       example_seeds(self.seed, examples, self.name), stop_ids, self.config,
                                       self.policy.max_new_tokens)
        return [Decoded(decode_text(tokenizer, r.token_ids[:-1] if r.finished else r.token_ids),
                        r.token_ids, r.usage, r.extra()) for r in results]


@dataclass
class GuideGreedyDecoder:
    """`guide-greedy`: plain greedy decoding by the guide alone, reported like speculative thinking (the guide
    writes every token and does all the FPE)."""

    name: str
    policy: SamplingPolicy  # greedy
    seed: int
    guide: str
    guide_identity: str
    trust_remote_code: bool = False

    needs_hf_engine = True  # two models hand one cache between them, token by token

    def __call__(self, engine: Engine, examples: Sequence[Example], task: Task) -> list[Decoded]:
        model, tokenizer = hf_parts(engine)
        guide = load_guide(self.guide, self.guide_identity, model, tokenizer, self.trust_remote_code)
        outputs = PlainDecoder(self.name, self.policy, self.seed)(HfEngine(guide, tokenizer), examples, task)
        for out in outputs:
            visible = out.usage.visible_tokens
            out.extra = {"fpe_small": 0, "fpe_guide": out.usage.fpe, "tokens_small": 0, "tokens_guide": visible,
                         "guide_steps": 0, "delimiter_points": 0, "guide_share": 1.0 if visible else 0.0}
        return outputs
