"""The chat turns of ReDuMix. Instruction strings are the seed's (shared/seeds/redumix.txt)."""

from __future__ import annotations

Message = dict[str, str]

REFLECT = "Please reflect on the above and outline corrections before answering again."
REDO = (
    "Now redo the task following your reflection as if you were answering for the first time. "
    "Do not rely on the information you retrieved from this conversation round."
)
CRITIQUE = "Check your answer. Is it right?"


def attempt_messages(prompt: str) -> list[Message]:
    """x: the original task, as the first user turn."""
    return [{"role": "user", "content": prompt}]


def critique_messages(prompt: str, attempt: str) -> list[Message]:
    """[x ‖ y1 ‖ CRITIQUE]: the model's own critique stands in for external feedback."""
    return [*attempt_messages(prompt), {"role": "assistant", "content": attempt}, {"role": "user", "content": CRITIQUE}]


def reflect_messages(prompt: str, attempt: str, feedback: str) -> list[Message]:
    """[x ‖ y1 ‖ r ‖ REFLECT]"""
    return [
        *attempt_messages(prompt),
        {"role": "assistant", "content": attempt},
        {"role": "user", "content": f"{feedback}\n{REFLECT}"},
    ]


def redo_messages(prompt: str, attempt: str, feedback: str, reflection: str) -> list[Message]:
    """x2 = [x ‖ y1 ‖ r ‖ c ‖ REDO]"""
    return [
        *reflect_messages(prompt, attempt, feedback),
        {"role": "assistant", "content": reflection},
        {"role": "user", "content": REDO},
    ]
