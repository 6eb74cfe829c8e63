"""JSON Lines files: one object a line, errors that name the file and line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def jsonl_objects(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of every non-blank line; a bad line is an error naming the file and line."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({exc.msg}); fix or remove that line") from exc


def read_jsonl_by_id(path: Path, field_name: str) -> dict[str, str]:
    """A human feedback file: one JSON object per line with 'id' and `field_name`. Errors name file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"feedback file not found: {path} (set redumix.feedback_file to a JSONL file with one "
            f"{{'id': ..., {field_name!r}: ...}} object a line)"
        )
    out: dict[str, str] = {}
    first: dict[str, int] = {}  # id -> the line it first appeared on
    for line_no, row in jsonl_objects(path):
        if not isinstance(row, dict) or not isinstance(row.get("id"), str) or not isinstance(row.get(field_name), str):
            raise ValueError(
                f"{path}:{line_no}: expected an object with string keys 'id' and {field_name!r}; "
                "fix or remove that line"
            )
        if row["id"] in out:
            raise ValueError(
                f"{path}:{line_no}: id {row['id']!r} appears twice (first on line {first[row['id']]}); "
                "keep one line per id"
            )
        out[row["id"]] = row[field_name]
        first[row["id"]] = line_no
    return out
