"""Plain values as tagged JSON: the only thing that crosses between the sandbox's runner and its judge.

`encode` runs in the runner, on whatever the model's code returned; `decode` runs in the judge and is the boundary
that matters: it builds None, bool, int, float, complex, str, bytes, bytearray, list, tuple, dict, set, frozenset,
range, an iterator, a dict view or a builtin type (`int`, ...) from JSON, and runs nothing. A subclass of a plain type
is sent as its base type, so a custom `__eq__` or `__bool__` never reaches the judge. Any other object stays where it
is and crosses as a handle (`other`): the judge sees an opaque `Handle` that equals only itself, and can pass it back
as an argument (MBPP's tests build `Pair(5, 24)` with the model's class and hand it to the model's function). Numbers
go as hex text, so a float comes back bit for bit and an int of any size crosses (the decimal limit is base 10's).

data/sandbox_judge.py imports this file by path inside the sandbox (it is a standard-library-only module); redumix
imports it as `redumix.data.sandbox_values` (the tests do).
"""

from __future__ import annotations

import binascii
import itertools
from _collections_abc import Iterator  # what collections.abc re-exports, without importing collections

try:  # the json module's C parts: the same parser and encoder without importing `re` and `enum` in every sandbox
    from _json import encode_basestring_ascii, make_encoder, make_scanner
except ImportError:  # another Python: the json module itself
    make_scanner = None

MAX_ITEMS = 100_000  # items taken from an iterator the model returns
MAX_DEPTH = 100  # nesting of a plain value


class NotPlain(Exception):
    """A value that cannot cross: nested too deeply, an endless iterator, or an object where no handle is allowed."""


class Handle:
    """An object of the other side, by key; equal only to itself, so no comparison with it passes by accident."""

    __slots__ = ("key", "label")

    def __init__(self, key, label):
        self.key, self.label = key, label

    def __repr__(self):
        return f"<{self.label} object>"


BUILTIN_TYPES = {t.__name__: t for t in (bool, int, float, complex, str, bytes, bytearray, list, tuple, dict, set,
                                          frozenset, range, type(None), object)}


def encode(value, other=None, depth=0):
    """`value` as tagged JSON. An object that is not plain goes as `{"obj": [other(value), its type's name]}`, or
    raises NotPlain when `other` is None."""
    if depth > MAX_DEPTH:
        raise NotPlain("a value nested too deeply (or holding itself)")
    if value is None or value is True or value is False:
        return value
    for kind, tag, convert in _ENCODERS:
        if isinstance(value, kind):
            return {tag: convert(value, other, depth + 1)}
    if isinstance(value, type) and BUILTIN_TYPES.get(value.__name__) is value:
        return {"type": value.__name__}
    if isinstance(value, Iterator) and not isinstance(value, Handle):
        items = list(itertools.islice(value, MAX_ITEMS + 1))
        if len(items) > MAX_ITEMS:
            raise NotPlain(f"an iterator of more than {MAX_ITEMS} items")
        return {"it": _many(items, other, depth + 1)}
    if other is None:
        raise NotPlain(f"a {type(value).__name__} object")
    return {"obj": [other(value), str(type(value).__name__)[:100]]}


def _many(values, other, depth):
    return [encode(v, other, depth) for v in values]


def _pairs(items, other, depth):
    return [[encode(k, other, depth), encode(x, other, depth)] for k, x in items]


_ENCODERS = [  # str first: a str is sent as a JSON string
    (str, "s", lambda v, o, d: str.__str__(v)),
    (int, "i", lambda v, o, d: hex(int.__index__(v))),
    (float, "f", lambda v, o, d: float.hex(v)),
    (complex, "c", lambda v, o, d: [float.hex(v.real), float.hex(v.imag)]),
    (bytearray, "ba", lambda v, o, d: binascii.b2a_base64(bytes(v), newline=False).decode()),
    (bytes, "b", lambda v, o, d: binascii.b2a_base64(bytes(v), newline=False).decode()),
    (list, "l", lambda v, o, d: _many(list.__iter__(v), o, d)),
    (tuple, "t", lambda v, o, d: _many(tuple.__iter__(v), o, d)),
    (frozenset, "fs", lambda v, o, d: _many(frozenset.__iter__(v), o, d)),
    (set, "set", lambda v, o, d: _many(set.__iter__(v), o, d)),
    (dict, "d", lambda v, o, d: _pairs(dict.items(v), o, d)),
    (range, "r", lambda v, o, d: [v.start, v.stop, v.step]),
    (type({}.keys()), "dk", lambda v, o, d: _many(v, o, d)),
    (type({}.values()), "dv", lambda v, o, d: _many(v, o, d)),
    (type({}.items()), "di", lambda v, o, d: _pairs(v, o, d)),
]


def decode(data, objects=None, depth=0):
    """The value tagged JSON stands for; builds plain objects only and runs nothing. `objects(key, label)` turns a
    handle into the object it stands for (the runner: its own object; the judge: a `Handle`); without it a handle is
    refused."""
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
        text = _checked(body, str)
        raw = binascii.a2b_base64(text)
        if binascii.b2a_base64(raw, newline=False).decode() != text:
            raise ValueError("not canonical base64")
        return raw if tag == "b" else bytearray(raw)
    if tag == "r":
        return range(*[_checked(x, int) for x in _checked(body, list)])
    if tag == "type":
        return BUILTIN_TYPES[_checked(body, str)]
    if tag == "obj" and objects is not None:
        key, label = _checked(body, list)
        return objects(_checked(key, str), _checked(label, str))
    if tag in ("d", "di"):
        pairs = [(decode(k, objects, depth + 1), decode(v, objects, depth + 1)) for k, v in _checked(body, list)]
        return dict(pairs) if tag == "d" else dict(pairs).items()
    items = [decode(v, objects, depth + 1) for v in _checked(body, list)]
    makers = {"l": list, "t": tuple, "set": set, "fs": frozenset, "it": iter, "dk": lambda x: dict.fromkeys(x).keys(),
              "dv": lambda x: dict(enumerate(x)).values()}
    if tag not in makers:
        raise ValueError(f"unknown tag {tag[:20]!r}")
    return makers[tag](items)


def _checked(value, kind):
    if type(value) is not kind:
        raise ValueError(f"expected {kind.__name__}")
    return value


# --- the wire: strict JSON, one message a line ---------------------------------------------------------------------


class _Context:
    """What _json's scanner reads from a JSONDecoder."""

    strict = True
    object_hook = object_pairs_hook = None
    parse_float, parse_int = float, int
    memo: dict = {}  # the scanner keeps its key strings here, and clears it after each call

    @staticmethod
    def parse_constant(name):
        raise ValueError(f"{name} is not strict JSON")


if make_scanner is not None:
    _scan = make_scanner(_Context())  # type: ignore[arg-type]  # any object with a decoder's attributes
    _encode = make_encoder(None, None, encode_basestring_ascii, None, ":", ",", False, False, False)  # type: ignore

    def dumps(value):
        """Strict JSON text, ASCII only (so it never holds a newline)."""
        return "".join(_encode(value, 0))

    def loads(text):
        try:
            value, end = _scan(text, 0)
        except StopIteration:
            raise ValueError("not JSON") from None
        if text[end:].strip():
            raise ValueError("extra data after the JSON value")
        return value
else:
    import json

    def dumps(value):
        return json.dumps(value, ensure_ascii=True, allow_nan=False, separators=(",", ":"))

    def loads(text):
        return json.loads(text, parse_constant=_Context.parse_constant)

