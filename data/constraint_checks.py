"""The checkers of `constraints` (data/constraints.py): how a text is read (words, whole words, bullets) and one
check per kind of constraint, each returning None when the text obeys, else the verifier's sentence naming what it
found ("The answer has 31 words, but the instruction asks for at most 20.").

**A blind reply** (`template_reply`) is built from the constraints alone, never the request: the phrases to start
and end with, a title, the words to include, the bullets, each filled with one word, in the case asked for, wrapped
in JSON when asked. It meets every kind but `min_words` without answering anything; eval's report gives its pass
rate (and that of `ok` alone) on the test examples as a baseline (`ConstraintsTask.blind_replies`)."""

from __future__ import annotations

import json
import re
import string
from typing import Any

TITLE_EXAMPLE = "<<a quiet morning>>"  # the instruction shows it, and the feedback quotes it

# --- reading a text -------------------------------------------------------------------------------------------------


def words(text: str) -> list[str]:
    """The whitespace-separated tokens that hold a letter or a digit."""
    return [token for token in text.split() if any(ch.isalnum() for ch in token)]


def has_word(text: str, word: str) -> bool:
    """`word` appears in `text` as a whole word, in any case."""
    return re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text, re.IGNORECASE) is not None


def _shown(tokens: list[str], limit: int = 3) -> str:
    """The first `limit` distinct tokens, their edge punctuation stripped, quoted: `"Dear", "I"`."""
    seen = list(dict.fromkeys(t.strip(string.punctuation) or t for t in tokens))
    return ", ".join(f'"{t}"' for t in seen[:limit]) + (", ..." if len(seen) > limit else "")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _listed(items: tuple[str, ...], joiner: str) -> str:
    quoted = [f'"{item}"' for item in items]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} {joiner} {quoted[-1]}"


def _the_words(items: tuple[str, ...], joiner: str) -> str:
    return f"the word{'s' if len(items) > 1 else ''} {_listed(items, joiner)}"


# --- the checkers: None when the text obeys, else the verifier's sentence naming what it found ----------------------


def check_lowercase(_: None, text: str) -> str | None:
    capitals = [t for t in text.split() if any(ch.isupper() for ch in t)]
    if capitals:
        return f"The answer contains capital letters ({_shown(capitals)}), but the instruction asks for all lowercase."
    return None


def check_uppercase(_: None, text: str) -> str | None:
    lower = [t for t in text.split() if any(ch.islower() for ch in t)]
    if lower:
        return (f"The answer contains lowercase letters ({_shown(lower)}), but the instruction asks for all capital "
                "letters.")
    return None


def check_max_words(n: int, text: str) -> str | None:
    count = len(words(text))
    if count <= n:
        return None
    return f"The answer has {_count(count, 'word')}, but the instruction asks for at most {n}."


def check_min_words(n: int, text: str) -> str | None:
    count = len(words(text))
    if count >= n:
        return None
    return f"The answer has {_count(count, 'word')}, but the instruction asks for at least {n}."


def check_include_words(wanted: tuple[str, ...], text: str) -> str | None:
    missing = tuple(w for w in wanted if not has_word(text, w))
    if missing:
        them = "it" if len(missing) == 1 else "them"
        return f"The answer does not use {_the_words(missing, 'and')}, but the instruction asks to include {them}."
    return None


def check_avoid_words(banned: tuple[str, ...], text: str) -> str | None:
    used = tuple(w for w in banned if has_word(text, w))
    if used:
        them = "it" if len(used) == 1 else "them"
        return f"The answer uses {_the_words(used, 'and')}, but the instruction asks to avoid {them}."
    return None


def check_avoid_letter(letter: str, text: str) -> str | None:
    hits = [t for t in text.split() if letter in t.lower()]
    if hits:
        return (f'The answer contains the letter "{letter}" (in {_shown(hits)}), but the instruction asks to avoid '
                "it.")
    return None


def check_start_with(phrase: str, text: str) -> str | None:
    body = text.strip()
    if body[: len(phrase)].lower() == phrase.lower() and not body[len(phrase) : len(phrase) + 1].isalnum():
        return None
    found = " ".join(body.split()[: len(phrase.split())])
    return f'The answer starts with "{found}", but the instruction asks it to start with "{phrase}".'


def check_end_with(phrase: str, text: str) -> str | None:
    body = text.strip()
    cut = len(body) - len(phrase)
    if cut >= 0 and body[cut:].lower() == phrase.lower() and not body[cut - 1 : cut].isalnum():
        return None
    found = " ".join(body.split()[-len(phrase.split()) :])
    return f'The answer ends with "{found}", but the instruction asks it to end with "{phrase}".'


def bullet_count(text: str) -> int:
    return sum(line.lstrip().startswith(("* ", "- ")) for line in text.splitlines())


def check_bullets(n: int, text: str) -> str | None:
    count = bullet_count(text)
    if count == n:
        return None
    return (f'The answer has {_count(count, "bullet point")} (lines starting with "* " or "- "), but the '
            f"instruction asks for exactly {n}.")


def check_no_commas(_: None, text: str) -> str | None:
    count = text.count(",")
    return None if not count else f"The answer contains {_count(count, 'comma')}, but the instruction asks for none."


_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL | re.IGNORECASE)


def check_json(_: None, text: str) -> str | None:
    body = text.strip()
    fenced = _FENCE.fullmatch(body)
    body = fenced.group(1) if fenced else body
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        return (f"The answer is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}), but the "
                "instruction asks for the whole answer in JSON.")
    if not isinstance(value, (dict, list)):
        return (f"The answer is a bare JSON {type(value).__name__}, but the instruction asks for the whole answer "
                "wrapped in JSON (an object or a list).")
    return None


_TITLE = re.compile(r"<<[^\n<>]*[^\s<>][^\n<>]*>>")  # something other than spaces inside, on one line


def check_title(_: None, text: str) -> str | None:
    if _TITLE.search(text):
        return None
    return (f"The answer has no title in double angular brackets, such as {TITLE_EXAMPLE}, but the instruction asks "
            "for one.")


def template_reply(values: dict[str, Any]) -> str:
    """The blind reply to constraints given as {kind: value}: the words its phrases, title, included words and
    bullets force, or one word when nothing does."""
    head = [values.get("start_with", ""), "<<done>>" if "title" in values else "", *values.get("include_words", ())]
    lines = [" ".join(piece for piece in head if piece), *["* done"] * values.get("bullets", 0),
             values.get("end_with", "")]
    text = "\n".join(line for line in lines if line) or "done"
    text = text.lower() if "lowercase" in values else text.upper() if "uppercase" in values else text
    return json.dumps([text]) if "json" in values else text
