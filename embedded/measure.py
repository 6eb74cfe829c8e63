"""What the built base scores on held-out arith `test` problems (its `metrics.json`), decoded by generate/'s decoders.

- greedy (`PlainDecoder` at temperature 0): accuracy, answers with no final number, and line accuracy;
- with `embedded.eval_reflection`, what reflection buys: ReDuMix at λ=0 decodes the redo from x2 alone, after the
  verifier's feedback and after the model's own critique (whose verdicts are scored against the verifier's);
- and forced check spans: reflective decoding that opens a hidden `<|reflect|>` span at every visible ` = ` (its
  periodic ablation with a period of one token) and lets the model end each span with its own `<|/reflect|>`.

The token limits are the ones the shipped base was measured with: 160 for an answer, 256 for a reflection, 32 for
a critique, and 400 in all (160 visible, 240 hidden) for an answer with forced check spans. A span that the model
does not close ends at the reflective decoder's default `reflect_length` and the answer goes on after it, since that
decoder never ends an answer inside a span (a model that writes `<|end|>` there used to stop with no answer).
"""

from __future__ import annotations

from collections.abc import Sequence

from tqdm import tqdm
from transformers import PreTrainedModel as Model
from transformers import PreTrainedTokenizerBase as Tokenizer

from redumix.common.ranks import rank
from redumix.data.arith import LINE, apply
from redumix.data.task import Example, Task
from redumix.embedded.config import EmbeddedConfig
from redumix.embedded.vocab import REFLECT_CLOSE, REFLECT_OPEN
from redumix.generate.decoder import Decoded, Decoder
from redumix.generate.hf_engine import HfEngine
from redumix.generate.plain import PlainDecoder
from redumix.generate.policy import SamplingPolicy
from redumix.generate.redumix import RedumixConfig, RedumixDecoder
from redumix.generate.reflective import ReflectiveConfig, ReflectiveDecoder

GREEDY = SamplingPolicy(temperature=0.0, max_new_tokens=160)
FORCED_HIDDEN_TOKENS = 240  # with GREEDY's 160 visible ones, the 400 tokens an answer with spans may take


def line_accuracy(solutions: list[str]) -> float:
    """Share of terse lines `a op b = r` whose r is right for their own a and b."""
    lines = [m for text in solutions for m in LINE.findall(text)]
    right = sum(apply(int(a), op, int(b)) == int(r) for a, op, b, r in lines)
    return right / max(1, len(lines))


def decode(
    decoder: Decoder, model: Model, tokenizer: Tokenizer, examples: Sequence[Example], task: Task, batch_size: int
) -> list[Decoded]:
    out: list[Decoded] = []
    engine = HfEngine(model, tokenizer)
    starts = range(0, len(examples), batch_size)
    for lo in tqdm(starts, desc=f"embedded: measuring {decoder.name}", unit="batch", disable=rank() != 0):
        out += decoder(engine, examples[lo : lo + batch_size], task)
    return out


def reflection_check(
    model: Model, tokenizer: Tokenizer, task: Task, examples: list[Example], feedback: str, seed: int,
    batch_size: int,
) -> dict[str, float | int]:
    """attempt -> feedback -> reflection -> redo decoded from x2 alone (greedy): does reflecting fix answers?

    feedback "verifier" is the answer check; "self" is the model's own critique of its attempt.
    """
    settings = RedumixConfig(lam=0.0, feedback=feedback, reflection_max_tokens=256, critique_max_tokens=32)
    decoder = RedumixDecoder(f"redumix-{feedback}@0", settings, GREEDY, seed)
    redos = decode(decoder, model, tokenizer, examples, task, batch_size)
    before = [d.extra["original_correct"] for d in redos]
    after = [task.is_correct(d.text, e) for d, e in zip(redos, examples, strict=True)]
    out = {
        "original_accuracy": round(sum(before) / len(examples), 4),
        "redo_accuracy": round(sum(after) / len(examples), 4),
        "fixed": sum(a and not b for a, b in zip(after, before, strict=True)),
        "broken": sum(b and not a for a, b in zip(after, before, strict=True)),
    }
    if feedback == "self":
        truth = [task.feedback(d.extra["original"], e) for d, e in zip(redos, examples, strict=True)]
        right = sum(d.extra["feedback"].strip() == t for d, t in zip(redos, truth, strict=True))
        out["critique_verdict_accuracy"] = round(right / len(examples), 4)
    return out


def forced_check_spans(
    model: Model, tokenizer: Tokenizer, task: Task, examples: list[Example], seed: int, batch_size: int
) -> dict[str, float]:
    """Greedy answers with a hidden check span opened at every visible ` = `: what the spans buy when always taken."""
    settings = ReflectiveConfig(
        ablation="periodic", period=1, trigger_after=[" = "], cooldown=0, stop="end_marker",
        budget_total=FORCED_HIDDEN_TOKENS, marker_start=REFLECT_OPEN, marker_end=REFLECT_CLOSE,
    )
    decoder = ReflectiveDecoder("reflective-forced", settings, GREEDY, seed)
    answers = [d.text for d in decode(decoder, model, tokenizer, examples, task, batch_size)]
    return {
        "accuracy": round(sum(map(task.is_correct, answers, examples)) / len(examples), 4),
        "line_accuracy": round(line_accuracy(answers), 4),
    }


def measure(model: Model, tokenizer: Tokenizer, task: Task, base: EmbeddedConfig, seed: int) -> dict:
    """Greedy accuracy on the first `embedded.eval_n` held-out test problems; with `embedded.eval_reflection`, what
    reflection and check spans buy."""
    examples, batch_size = task.examples("test", base.eval_n), base.eval_batch_size
    greedy = PlainDecoder("greedy", GREEDY, seed)
    attempts = [d.text for d in decode(greedy, model, tokenizer, examples, task, batch_size)]
    correct = [task.is_correct(a, e) for a, e in zip(attempts, examples, strict=True)]
    metrics: dict = {
        "n": len(examples),
        "accuracy": round(sum(correct) / len(examples), 4),
        "no_answer": sum(task.answer(a) is None for a in attempts),
        "line_accuracy": round(line_accuracy(attempts), 4),
    }
    if base.eval_reflection:
        for feedback in ("verifier", "self"):
            metrics[f"reflection_{feedback}"] = reflection_check(model, tokenizer, task, examples, feedback, seed,
                                                                 batch_size)
        metrics["forced_check_spans"] = forced_check_spans(model, tokenizer, task, examples, seed, batch_size)
    return metrics
