"""Answer extraction and checking, the way the field grades GSM8K, plus verifier feedback that hides the gold."""

from __future__ import annotations

import re
from fractions import Fraction

from redumix.data.task import Example

_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?"
_HASHES = re.compile(r"####\s*(" + _NUMBER + ")")
_ANSWER_IS = re.compile(r"[Tt]he (?:final )?answer is:?\s*\$?\\?\(?\s*(" + _NUMBER + ")")
_BOXED = re.compile(r"\\boxed\{\s*(" + _NUMBER + r")\s*\}")
_ANY_NUMBER = re.compile(_NUMBER)


def extract_answer(text: str) -> str | None:
    """The final answer: `#### N`, else "The answer is N", else a final `\\boxed{N}`, else the last number."""
    for pattern in (_HASHES, _ANSWER_IS, _BOXED):
        found = pattern.findall(text)
        if found:
            return _normalise(found[-1])
    found = _ANY_NUMBER.findall(text)
    return _normalise(found[-1]) if found else None


def _normalise(number: str) -> str:
    return number.replace(",", "").replace("$", "").rstrip(".")


def as_number(text: str | None) -> Fraction | None:
    if text is None:
        return None
    try:
        return Fraction(_normalise(text.strip()))
    except (ValueError, ZeroDivisionError):
        return None


def is_correct(completion: str, reference: str) -> bool:
    """True when the completion's final answer equals the reference as a number (so `18.0` == `18`)."""
    predicted = as_number(extract_answer(completion))
    gold = as_number(reference)
    return predicted is not None and gold is not None and predicted == gold


def verifier_feedback(completion: str, reference: str) -> str:
    """What an answer-checking verifier tells the model. It names the model's own answer, never the gold one."""
    predicted = extract_answer(completion)
    return verdict_feedback(predicted, predicted is not None and is_correct(completion, reference))


def verdict_feedback(predicted: str | None, correct: bool) -> str:
    """The verifier's sentence for an answer and a verdict (the `random` feedback ablation picks the verdict)."""
    if predicted is None:
        return "I could not find a final answer in your solution."
    return f"Your final answer {predicted} is {'correct' if correct else 'wrong'}."


def grade(completion: str, example: Example) -> bool:
    """`is_correct` against the example's gold answer: the Task method of every GSM8K-style task."""
    return is_correct(completion, example.reference)


def feedback(completion: str, example: Example) -> str:
    """`verifier_feedback` on an example: the Task method of every GSM8K-style task."""
    return verifier_feedback(completion, example.reference)
