"""Resolving a recipe into a config dataclass: its defaults, then a YAML recipe, then `key.sub=value` overrides.

This module knows dataclasses, YAML and where each value came from; it knows no section (`pipeline/config.py`
composes those). Unknown keys, wrong types and out-of-range values (a section's `__post_init__` check) are all
collected and reported together, each naming the recipe file (or the command line) and the dotted key.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from redumix.common.files import read_text

T = TypeVar("T")


class ConfigError(ValueError):
    """A recipe or override is wrong. The message lists every problem, one per line."""


def resolve(cls: type[T], recipe: str | Path | None, overrides: list[str] = ()) -> T:
    """Defaults of `cls` <- recipe YAML <- overrides. Raises ConfigError listing every problem."""
    errors: list[str] = []
    raw: dict[str, Any] = {}
    origin: dict[str, str] = {}  # dotted key -> where its value came from, for error messages
    if recipe is not None:
        recipe = Path(recipe)
        if not recipe.is_file():
            raise ConfigError(
                f"recipe not found: {recipe} (pass --recipe PATH to a YAML file, e.g. recipes/tiny.yaml)"
            )
        try:
            loaded = yaml.safe_load(read_text(recipe, fix="save the recipe as UTF-8"))
        except yaml.YAMLError as exc:
            raise ConfigError(_yaml_error(recipe, exc)) from exc
        except ValueError as exc:  # a byte that is not UTF-8, named with its line
            raise ConfigError(str(exc)) from exc
        if not loaded:  # empty, only comments, or `{}`: a truncated file or the wrong one, not a wish for the defaults
            raise ConfigError(f"{recipe}: the recipe sets nothing (it is empty or holds only comments); write its "
                              "settings there, or pass the recipe you meant to --recipe")
        if not isinstance(loaded, dict):
            raise ConfigError(f"{recipe}: the top level must be a mapping of sections, got {type(loaded).__name__}")
        raw = loaded
        _record_origin(raw, str(recipe), "", origin)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            errors.append(f"command line: override {item!r} is not of the form key.sub=value")
            continue
        _set_dotted(raw, key.strip(), yaml.safe_load(text) if text.strip() else "", errors)
        origin[key.strip()] = "command line"
    config = _build(cls, raw, "", origin, errors)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    return config


def _yaml_error(recipe: Path, exc: yaml.YAMLError) -> str:
    """`FILE:LINE: not valid YAML (what, and where the construct it broke began); fix ...`."""
    mark = getattr(exc, "problem_mark", None)
    if mark is None:
        return f"{recipe}: not valid YAML ({exc}); fix the file"
    problem = getattr(exc, "problem", None) or "syntax error"
    context, began = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and began is not None:
        problem += f", {context} from line {began.line + 1}"
    return f"{recipe}:{mark.line + 1}: not valid YAML ({problem}); fix the YAML there"


def config_to_yaml(config: Any) -> str:
    """The resolved config as YAML, sections in their declared order: what every stage saves beside its outputs."""
    return yaml.safe_dump(dataclasses.asdict(config), sort_keys=False)


def _record_origin(raw: dict, where: str, prefix: str, origin: dict[str, str]) -> None:
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        origin[dotted] = where
        if isinstance(value, dict):
            _record_origin(value, where, dotted + ".", origin)


def _set_dotted(raw: dict, dotted: str, value: Any, errors: list[str]) -> None:
    node = raw
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            errors.append(f"command line: {dotted!r}: {part!r} is a value, not a section")
            return
        node = child
    node[parts[-1]] = value


def _where(origin: dict[str, str], dotted: str) -> str:
    inside = sorted({where for key, where in origin.items() if key.startswith(dotted + ".")}) if dotted else []
    if dotted not in origin and inside:
        return " and ".join(inside)
    while dotted and dotted not in origin:
        dotted = dotted.rpartition(".")[0]
    return origin.get(dotted, "defaults")


def _build(cls: type, raw: Any, prefix: str, origin: dict[str, str], errors: list[str]) -> Any:
    if not isinstance(raw, dict):
        errors.append(f"{_where(origin, prefix.rstrip('.'))}: {prefix.rstrip('.')!r} must be a mapping")
        return cls()
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in raw:
        if key not in known:
            dotted = prefix + str(key)
            # A key one level down (a recipe written before `task.steps_min` became `task.arith.steps_min`)
            deeper = [f"{name}.{key}" for name in known if dataclasses.is_dataclass(hints[name])
                      and key in {f.name for f in dataclasses.fields(hints[name])}]
            close = deeper or difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {prefix + close[0]!r}?)" if close else f" (known: {', '.join(known)})"
            errors.append(f"{_where(origin, dotted)}: unknown key {dotted!r}{hint}")
    kwargs = {}
    for name in known:
        if name not in raw:
            continue
        dotted = prefix + name
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, raw[name], dotted + ".", origin, errors)
        else:
            ok, value = _coerce(raw[name], hint)
            if ok:
                kwargs[name] = value
            else:
                errors.append(f"{_where(origin, dotted)}: {dotted!r} = {raw[name]!r} is not {_type_name(hint)}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        # The check names fields, not where they were set: find the given keys it names, to point at them. A nested
        # section was checked when it was built, so only plain values are suspects (`task.name` may name `arith`).
        named = [prefix + name for name in known if name in raw and not dataclasses.is_dataclass(hints[name])
                 and re.search(rf"\b{name}\b", str(exc))]
        if named:
            where = " and ".join(sorted({_where(origin, dotted) for dotted in named}))
            errors.append(f"{where}: {', '.join(repr(d) for d in named)}: {exc}")
        else:
            section = prefix.rstrip(".")
            errors.append(f"{_where(origin, section)}: section {section or 'top level'!r}: {exc}")
        return cls()


def _coerce(value: Any, hint: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return True, value
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            ok, out = _coerce(value, arg)
            if ok:
                return True, out
        return False, None
    if hint is type(None):
        return value is None, None
    if origin is Literal:
        return (value in args), value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False, None
        inner = args[0] if args else Any
        out = []
        for item in value:
            ok, item_value = _coerce(item, inner)
            if not ok:
                return False, None
            out.append(item_value)
        return True, out
    if origin is dict:
        return isinstance(value, dict), value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return (isinstance(value, int) and not isinstance(value, bool)), value
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        return False, None
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return True, str(value)
        return False, None
    return isinstance(value, hint), value


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
