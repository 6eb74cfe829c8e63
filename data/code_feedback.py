"""The `code` task's verifier feedback: a sandbox outcome in words, at one of three details.

| detail | what it adds |
|---|---|
| `assert` | the first failing assert (or: timed out after N s, does not compile, no code block) |
| `value` | what the last call into the model's code returned (its repr, cut to 200 characters) or raised |
| `traceback` | the traceback through the model's code |

It names the model's own output and the problem's test, never the reference solution. docs/code.md shows each kind.
"""

from __future__ import annotations

import re

from redumix.data.sandbox import Outcome

DETAILS = ("assert", "value", "traceback")


def feedback_text(outcome: Outcome, fenced: bool, tests: list[str], entry_point: str, detail: str,
                  timeout_s: float) -> str:
    if detail not in DETAILS:
        raise ValueError(f"unknown feedback detail {detail!r} (known: {', '.join(DETAILS)})")
    if outcome.passed:
        return "Your code passes all the tests."
    if outcome.kind == "nocode" or (not fenced and outcome.kind == "load" and outcome.error.startswith("SyntaxError")):
        return "Your reply has no code block: write your solution in a ```python block."
    line = outcome.line or (tests[outcome.test].strip() if outcome.test is not None else "")
    if entry_point:  # HumanEval's check calls the function `candidate`: name it as the model did
        line = re.sub(r"\bcandidate\b", entry_point, line)
    test = f"this test:\n{line}" if line else ""
    text = _what_happened(outcome, test, detail, timeout_s)
    if detail == "traceback" and outcome.traceback and outcome.kind in ("raised", "load"):
        text += f"\n{outcome.traceback.rstrip()}"
    return text


def _what_happened(outcome: Outcome, test: str, detail: str, timeout_s: float) -> str:
    kind, call = outcome.kind, outcome.call
    if kind == "timeout":
        return f"Your code timed out after {timeout_s:g} s " + (f"on {test}" if test else "before any test ran.")
    if kind == "load":
        error = re.sub(r" \(<solution>, line (\d+)\)", r" (line \1)", outcome.error)
        if error.startswith("SyntaxError") or error.startswith("IndentationError"):
            return f"Your code does not compile: {error}."
        return f"Your code raised {error} when it was run, before any test." if detail != "assert" else (
            "Your code raised an exception when it was run, before any test.")
    if kind == "exit":
        return f"Your code exited ({outcome.status}) " + (f"during {test}" if test else "before any test ran.")
    if kind in ("protocol", "crash"):
        return "Your code interfered with the test harness, so no test could be checked."
    text = f"Your code fails {test}"
    if detail == "assert":
        return text
    if not call:  # the test stopped before calling the code: a name it does not define, say
        return f"{text}\nThe test raised {outcome.error}." if outcome.error else text
    if kind == "wrong":
        return f"{text}\n{call} returned {outcome.returned}."
    if kind == "raised":
        return f"{text}\n{call} raised {outcome.error}."
    if kind == "unplain":
        return f"{text}\n{call} returned {outcome.error}, which is not a value the test can compare."
    return f"{text}\nThe test raised {outcome.error} on what {call} returned ({outcome.returned})."
