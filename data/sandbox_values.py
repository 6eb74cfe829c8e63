"""Plain values as tagged JSON: the only thing that crosses between the sandbox's runner and its judge.

`encode` runs in the runner, on whatever the model's code returned; `decode` runs in the judge and is the boundary
that matters: it builds None, bool, int, float, complex, str, bytes, bytearray, list, tuple, dict, set, frozenset,
range, an iterator or a dict view from JSON, and runs nothing. A subclass of a plain type is sent as its base type,
so a custom `__eq__` or `__bool__` never reaches the judge; anything else is `NotPlain`. Numbers go as hex text, so a
float comes back bit for bit and an int of any size crosses (Python's decimal limit is for base 10 only).

data/sandbox_judge.py imports this file by path inside the sandbox (it is a standard-library-only module); redumix
imports it as `redumix.data.sandbox_values` (the tests do).
"""

from __future__ import annotations

import base64
import itertools
from collections.abc import Iterator

MAX_ITEMS = 100_000  # items taken from an iterator the model returns
MAX_DEPTH = 100  # nesting of a plain value


class NotPlain(Exception):
    """A value that is not plain: it cannot cross to the judge."""



def encode(value, depth=0):
    """A plain value as tagged JSON. Subclasses of the plain types go as their base type, so a custom `__eq__`
    never crosses; anything else raises NotPlain."""
    if depth > MAX_DEPTH:
        raise NotPlain("a value nested too deeply (or holding itself)")
    if value is None or value is True or value is False:
        return value
    for kind, tag, convert in _ENCODERS:
        if isinstance(value, kind):
            return {tag: convert(value, depth + 1)}
    if isinstance(value, Iterator):
        items = list(itertools.islice(value, MAX_ITEMS + 1))
        if len(items) > MAX_ITEMS:
            raise NotPlain(f"an iterator of more than {MAX_ITEMS} items")
        return {"it": [encode(v, depth + 1) for v in items]}
    raise NotPlain(f"a {type(value).__name__} object")


def _many(values, depth):
    return [encode(v, depth) for v in values]


_ENCODERS = [  # str first: a str is sent as a JSON string
    (str, "s", lambda v, d: str.__str__(v)),
    (int, "i", lambda v, d: hex(int.__index__(v))),
    (float, "f", lambda v, d: float.hex(v)),
    (complex, "c", lambda v, d: [float.hex(v.real), float.hex(v.imag)]),
    (bytearray, "ba", lambda v, d: base64.b64encode(bytes(v)).decode()),
    (bytes, "b", lambda v, d: base64.b64encode(bytes(v)).decode()),
    (list, "l", lambda v, d: _many(list.__iter__(v), d)),
    (tuple, "t", lambda v, d: _many(tuple.__iter__(v), d)),
    (frozenset, "fs", lambda v, d: _many(frozenset.__iter__(v), d)),
    (set, "set", lambda v, d: _many(set.__iter__(v), d)),
    (dict, "d", lambda v, d: [[encode(k, d), encode(x, d)] for k, x in dict.items(v)]),
    (range, "r", lambda v, d: [v.start, v.stop, v.step]),
    (type({}.keys()), "dk", lambda v, d: _many(v, d)),
    (type({}.values()), "dv", lambda v, d: _many(v, d)),
    (type({}.items()), "di", lambda v, d: [[encode(k, d), encode(x, d)] for k, x in v]),
]


def decode(data, refs=None, depth=0):
    """The value tagged JSON stands for; builds plain objects only and runs nothing. `refs` resolves `{"ref": name}`
    (the runner's globals, used by the runner for the judge's arguments); the judge decodes without it."""
    if depth > MAX_DEPTH:
        raise ValueError("a value nested too deeply")
    if data is None or type(data) is bool:
        return data
    if type(data) is not dict or len(data) != 1:
        raise ValueError("not a tagged plain value")
    ((tag, body),) = data.items()
    if tag == "s":
        return _checked(body, str)
    if tag == "i":
        return int(_checked(body, str), 16)
    if tag == "f":
        return float.fromhex(_checked(body, str))
    if tag == "c":
        real, imag = _checked(body, list)
        return complex(float.fromhex(_checked(real, str)), float.fromhex(_checked(imag, str)))
    if tag in ("b", "ba"):
        raw = base64.b64decode(_checked(body, str), validate=True)
        return raw if tag == "b" else bytearray(raw)
    if tag == "r":
        return range(*[_checked(x, int) for x in _checked(body, list)])
    if tag == "ref" and refs is not None:
        return refs[_checked(body, str)]
    if tag in ("d", "di"):
        pairs = [(decode(k, refs, depth + 1), decode(v, refs, depth + 1)) for k, v in _checked(body, list)]
        return dict(pairs) if tag == "d" else dict(pairs).items()
    items = [decode(v, refs, depth + 1) for v in _checked(body, list)]
    makers = {"l": list, "t": tuple, "set": set, "fs": frozenset, "it": iter, "dk": lambda x: dict.fromkeys(x).keys(),
              "dv": lambda x: dict(enumerate(x)).values()}
    if tag not in makers:
        raise ValueError(f"unknown tag {tag[:20]!r}")
    return makers[tag](items)


def _checked(value, kind):
    if type(value) is not kind:
        raise ValueError(f"expected {kind.__name__}")
    return value
