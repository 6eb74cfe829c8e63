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
from redumix.pipeline.habits import foreign_hint

T = TypeVar("T")


class ConfigError(ValueError):
    """A recipe or override is wrong. The message lists every problem, one per line."""


# Keys that were renamed: the old spelling's error names the new one.
RENAMED = {"base": "embedded", "train.lmbda": "train.on_policy_share",
           # one engine for every stage since the engine seam (generate/engine.py)
           "harvest.engine": "engine", "eval.engine": "engine", "ladder.engine": "engine"}


# A recipe may start from another: `extends: NAME_OR_PATH` reads that recipe first and this file's keys on top (what
# `redumix config --recipe R --name N key=value` writes: only what differs from R).
EXTENDS = "extends"


def resolve(
    cls: type[T], recipe: str | Path | None, overrides: list[str] = (),
    find: typing.Callable[[str, Path], Path] | None = None,
) -> T:
    """Defaults of `cls` <- recipe YAML (after the recipes it extends) <- overrides. Raises ConfigError listing every
    problem. `find(name, folder)` locates a recipe that another extends (a path, relative to the extending file's
    folder, or a bundled recipe's name)."""
    errors: list[str] = []
    origin: dict[str, str] = {}  # dotted key -> where its value came from, for error messages
    raw = read_recipe(Path(recipe), origin, find) if recipe is not None else {}
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


def read_recipe(
    recipe: Path, origin: dict[str, str], find: typing.Callable[[str, Path], Path] | None = None,
    extended_by: tuple[Path, ...] = (),
) -> dict[str, Any]:
    """A recipe file's mapping, on top of the recipe it `extends` (recursively); `origin` learns each key's file."""
    if not recipe.is_file():
        raise ConfigError(f"recipe not found: {recipe} (pass --recipe PATH to a YAML file, e.g. recipes/tiny.yaml)")
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
    parent = loaded.pop(EXTENDS, None)
    raw: dict[str, Any] = {}
    if parent is not None:
        if not isinstance(parent, str) or find is None:
            raise ConfigError(f"{recipe}: {EXTENDS!r} must name one recipe (a path or a bundled recipe's name)")
        path = find(parent, recipe.parent).resolve()
        if path in extended_by or path == recipe.resolve():
            raise ConfigError(f"{recipe}: {EXTENDS}: {parent} extends this recipe again (a cycle); remove one")
        raw = read_recipe(path, origin, find, (*extended_by, recipe.resolve()))
        raw.pop("name", None)  # a recipe is named by itself (or its file's stem), never after the one it extends
    _record_origin(loaded, str(recipe), "", origin)
    return _merged(raw, loaded)


def _merged(below: dict[str, Any], above: dict[str, Any]) -> dict[str, Any]:
    """`above`'s keys on top of `below`'s, section by section."""
    out = dict(below)
    for key, value in above.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def changed_keys(resolved: Any, start: Any) -> dict[str, Any]:
    """The nested mapping of the keys whose value in `resolved` differs from `start` (two configs of one class)."""
    def walk(a: dict, b: dict) -> dict:
        out = {}
        for key, value in a.items():
            if isinstance(value, dict) and isinstance(b.get(key), dict):
                inner = walk(value, b[key])
                if inner:
                    out[key] = inner
            elif b.get(key) != value:
                out[key] = value
        return out

    return walk(dataclasses.asdict(resolved), dataclasses.asdict(start))


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
            renamed = [RENAMED[dotted]] if dotted in RENAMED else []
            close = renamed or deeper or difflib.get_close_matches(str(key), known, n=1)
            shown = close[0] if renamed else prefix + close[0] if close else ""
            hint = f" (did you mean {shown!r}?)" if close else f" (known: {', '.join(known)})"
            foreign = None if renamed else foreign_hint(dotted)  # TRL's `num_train_epochs`: redumix's key
            hint = f" ({foreign})" if foreign else hint
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
