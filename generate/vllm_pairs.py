"""The ReDuMix mixture inside vLLM: a V1 logits processor that pairs two requests, x and x2, and decodes both from
p_mix. vLLM has no notion of a request that reads another's logits, so the pair meets in the batch: each request
carries `extra_args["redumix"]` with its pair key and role, and at every step where both rows are present at the
same output index the processor computes

    log p_mix = log_softmax(λ·log_softmax(x row) + (1−λ)·log_softmax(x2 row))

with `mixture_topk`, the harvest's own function (float32), draws one token and forces both rows to it.

Why the draw is ours and not vLLM's: vLLM's sampler would draw each row apart, with noise that depends on the batch.
The processor draws with redumix's counter-based Gumbel noise (`sample_tokens`, seeded by the pair's seed and the
output index), so a redo is the same whatever else is in the batch, and the same tokens the Hugging Face harvest
draws up to float rounding. vLLM then sees a row with one finite logit and, at temperature 0, emits it. Plain
requests tagged with role `solo` are drawn the same way from their own row (the harvest's attempt, critique and
reflection), so every stage of a vLLM harvest samples with the Hugging Face harvest's noise.

At λ = 0 or 1 the mixture is one context's distribution exactly (`mixture_topk`'s ends), so the engine sends that
context alone as one request of role `single`, and the processor treats its row as both members of its pair:
p_mix, its top-k and tail, and the draw are the pair's, at half the decoding.

A pair is split when vLLM does not decode both members in one step: one is waiting or preempted (absent partner),
their output lengths differ, or one drew from half-prefilled logits (chunked prefill discards that row's token, so
the lengths differ from the next step on). vLLM never promises to keep a pair in step, so the processor checks at
every step, marks the pair split in the ledger and forces the stop token on whatever is left of it;
`vllm_engine.py` retries split pairs and never writes one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from redumix.generate.mixture import mixture_topk
from redumix.generate.policy import SamplingPolicy, policy_logprobs, sample_tokens

TAG = "redumix"  # the key of SamplingParams.extra_args that the processor reads


@dataclass
class PairLog:
    """What the processor saw of one pair (or one solo request): its draws by output index, and whether it split."""

    split: bool = False
    # output index -> (token, top-k ids, top-k log p_mix, log of the mass outside the top-k); a pair only
    draws: dict[int, tuple[int, list[int], list[float], float]] = field(default_factory=dict)


# Keyed by the requests' `key`. The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the processor
# and the caller share it; the caller registers a key before submitting and pops it after reading the outputs.
LEDGER: dict[str, PairLog] = {}


@dataclass
class _Row:
    key: str
    role: str  # "x", "x2", "single" (λ 0 or 1: the one context p_mix reads) or "solo"
    spec: dict  # the request's extra_args[TAG]: seed, policy, and for a pair λ and top-k
    out: list[int]  # vLLM's live list of the request's output ids: its length is the index of the next draw


class PairMixer(LogitsProcessor):
    """Draws every tagged request's next token with redumix's noise; mixes x and x2 of a pair into p_mix."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, _Row] = {}  # persistent-batch index -> the tagged request there

    def is_argmax_invariant(self) -> bool:
        return False  # it forces the token, so vLLM must apply it before a greedy argmax too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        # The interface's order: removed, then added, then moved.
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _prompt, out in batch_update.added:
            spec = (params.extra_args or {}).get(TAG) if params is not None else None
            if spec is None:
                self.rows.pop(index, None)
            else:
                self.rows[index] = _Row(spec["key"], spec["role"], spec, out)
        for a, b, direction in batch_update.moved:
            row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
            if row_a is not None:
                self.rows[b] = row_a
            if row_b is not None and direction == MoveDirectionality.SWAP:
                self.rows[a] = row_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        solos, pairs, in_step = [], {}, []
        for index, row in self.rows.items():
            if index >= logits.shape[0]:
                continue
            if row.role == "solo":
                solos.append((index, row))
            elif row.role == "single":  # both members of its pair: it cannot split
                in_step.append(((index, row), (index, row), LEDGER.setdefault(row.key, PairLog())))
            else:
                pairs.setdefault(row.key, {})[row.role] = (index, row)
        if solos:
            self._draw_solos(logits, solos)
        for key, members in pairs.items():
            log = LEDGER.setdefault(key, PairLog())
            x, x2 = members.get("x"), members.get("x2")
            if log.split or x is None or x2 is None or len(x[1].out) != len(x2[1].out):
                log.split = True  # absent partner, or out of step (a chunked prefill discarded one row's draw)
                for index, row in members.values():
                    _force(logits, [index], [row.spec["stop"]])
            else:
                in_step.append((x, x2, log))
        if in_step:
            self._draw_pairs(logits, in_step)
        return logits

    def _draw_solos(self, logits: torch.Tensor, solos: list[tuple[int, _Row]]) -> None:
        for policy, group in _by_policy(solos):
            index = [i for i, _ in group]
            lp = policy_logprobs(logits[index], policy)
            tokens = _draw(lp, policy, group)
            _force(logits, index, tokens.tolist())

    def _draw_pairs(self, logits: torch.Tensor, in_step: list) -> None:
        by_setting: dict[tuple, list] = {}
        for x, x2, log in in_step:
            spec = x[1].spec
            by_setting.setdefault((_policy_key(spec), spec["lam"], spec["topk"]), []).append((x, x2, log))
        for (key, lam, topk), group in by_setting.items():
            policy = SamplingPolicy(*key)
            ix, ix2 = [x[0] for x, _, _ in group], [x2[0] for _, x2, _ in group]
            mix, top, tail = mixture_topk(logits[ix], logits[ix2], lam, topk)
            lp = mix if policy.greedy else policy_logprobs(mix, policy)
            tokens = _draw(lp, policy, [x for x, _, _ in group]).tolist()
            ids, values, tails = top.indices.tolist(), top.values.tolist(), tail.tolist()
            for j, (x, _, log) in enumerate(group):
                log.draws[len(x[1].out)] = (tokens[j], ids[j], values[j], tails[j])
            _force(logits, ix + ix2, tokens + tokens)


def _policy_key(spec: dict) -> tuple[float, float, int]:
    return (spec["temperature"], spec["top_p"], spec["top_k"])  # SamplingPolicy's first three fields, in order


def _by_policy(rows: list[tuple[int, _Row]]) -> list[tuple[SamplingPolicy, list[tuple[int, _Row]]]]:
    groups: dict = {}
    for index, row in rows:
        groups.setdefault(_policy_key(row.spec), []).append((index, row))
    return [(SamplingPolicy(*key), group) for key, group in groups.items()]


def _draw(logprobs: torch.Tensor, policy: SamplingPolicy, rows: list[tuple[int, _Row]]) -> torch.Tensor:
    """Argmax when greedy, else Gumbel-max with noise that is a function of (the row's seed, its output index)."""
    seeds = torch.tensor([row.spec["seed"] for _, row in rows], dtype=torch.long, device=logprobs.device)
    steps = torch.tensor([len(row.out) for _, row in rows], dtype=torch.long, device=logprobs.device)
    return sample_tokens(logprobs, policy, seeds, steps)


def _force(logits: torch.Tensor, index: list[int], tokens: list[int]) -> None:
    """Rows `index` can emit only `tokens` (one each): vLLM's greedy argmax then emits exactly the drawn token."""
    rows = torch.tensor(index, dtype=torch.long, device=logits.device)
    logits[rows] = float("-inf")
    logits[rows, torch.tensor(tokens, dtype=torch.long, device=logits.device)] = 0.0
