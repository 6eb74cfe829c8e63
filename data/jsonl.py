"""Human feedback files: one JSON object a line with an id, errors that name the file and line (the lines are read
by `redumix.common.files.read_jsonl`, which names a bad byte's or a bad line's file and line)."""

from __future__ import annotations

from pathlib import Path

from redumix.common.files import read_jsonl


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
    for line_no, row in read_jsonl(path):
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
