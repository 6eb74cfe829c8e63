"""The chat turns of ReDuMix and PDR. REFLECT and REDO are the ReDuMix paper's own instruction strings."""

from __future__ import annotations

Message = dict[str, str]

REFLECT = "Please reflect on the above and outline corrections before answering again."
REDO = (
    "Now redo the task following your reflection as if you were answering for the first time. "
    "Do not rely on the information you retrieved from this conversation round."
)
CRITIQUE = "Check your answer. Is it right?"
# The redo turn, a protocol lever (`redumix.instruction`): the paper's own; one that asks for a new solution rather
# than a rewrite (small models told to "redo" mostly copy their attempt: arXiv:2507.14295); or one that asks for the
# reply alone (real models' redos copied the reflection or chatted about the task: docs/real-models.md).
REDO_INSTRUCTIONS = {
    "redo": REDO,
    "fresh": "Now solve the task again from the beginning with a new solution. Do not copy your earlier answer: "
             "work it out afresh, using what your reflection found.",
    "answer": "Now reply to my original request again, improved by your reflection. Write only the reply itself: no "
              "greeting, no apology, and nothing about the request or your reflection.",
}


def attempt_messages(prompt: str) -> list[Message]:
    """x: the original task, as the first user turn."""
    return [{"role": "user", "content": prompt}]


def critique_messages(prompt: str, attempt: str) -> list[Message]:
    """[x ‖ y1 ‖ CRITIQUE]: the model's own critique stands in for external feedback."""
    return [
        *attempt_messages(prompt), {"role": "assistant", "content": attempt}, {"role": "user", "content": CRITIQUE},
    ]


def reflect_messages(prompt: str, attempt: str, feedback: str) -> list[Message]:
    """[x ‖ y1 ‖ r ‖ REFLECT]"""
    return [
        *attempt_messages(prompt),
        {"role": "assistant", "content": attempt},
        # With no feedback (the `none` ablation) the turn is the instruction alone.
        {"role": "user", "content": f"{feedback}\n{REFLECT}" if feedback else REFLECT},
    ]


LONGHAND = "Work it out the long way, checking each step."


def longhand_messages(prompt: str) -> list[Message]:
    """[x ‖ LONGHAND]: the task, asking for the careful procedure that reflections use, as visible working."""
    return [{"role": "user", "content": f"{prompt}\n{LONGHAND}"}]


REFINE = "Solve it again. Check each step the long way before you trust it."


def format_workspace(solutions: list[str]) -> str:
    """The PDR workspace: earlier solutions, numbered, each ending with its final answer."""
    return "\n\n".join(f"Solution {i}:\n{text.strip()}" for i, text in enumerate(solutions, start=1))


def refine_messages(prompt: str, workspace: str) -> list[Message]:
    """PDR refine step: [x ‖ "Earlier solutions:" ‖ workspace ‖ REFINE] as one user turn."""
    return [{"role": "user", "content": f"{prompt}\nEarlier solutions:\n{workspace.strip()}\n{REFINE}"}]


DISTILL = (
    "Summarise these solutions briefly: list the distinct final answers, which steps they agree on, "
    "and where they disagree. Do not solve the problem again."
)


def distill_messages(prompt: str, drafts: list[str]) -> list[Message]:
    """PDR model distill step: [x ‖ drafts ‖ DISTILL]; the reply becomes the bounded workspace."""
    return [{"role": "user", "content": f"{prompt}\nSolutions:\n{format_workspace(drafts)}\n{DISTILL}"}]


def redo_messages(prompt: str, attempt: str, feedback: str, reflection: str, instruction: str = REDO) -> list[Message]:
    """x2 = [x ‖ y1 ‖ r ‖ c ‖ REDO] (`instruction`: one of REDO_INSTRUCTIONS, `redumix.instruction`)"""
    return [
        *reflect_messages(prompt, attempt, feedback),
        {"role": "assistant", "content": reflection},
        {"role": "user", "content": instruction},
    ]
