"""Files every layer writes and reads: atomic writes (a reader sees all of a file or none of it), strict JSON, the
metrics log, and text inputs read with errors that name the file and line. The bottom of the import graph: it
imports nothing of redumix but `common/`.

Every JSON the project writes goes through `json_text`: strict JSON (`allow_nan=False`), in which a figure that is
not finite (NaN, an infinity: a mean of nothing, say) is `null`, so `jq`, JavaScript and
`json.loads(..., parse_constant=...)` read every file. The writer that knows why a figure is undefined says so beside
it (a `*_note` key, or the Markdown).

Every text input (task data, recipes, feedback files, the run folder's own JSON read back) goes through `read_text`
or `read_jsonl`, so a byte that is not UTF-8, or a line that is not JSON, is one error naming `FILE:LINE`.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from redumix.common.ranks import rank


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same folder, fsync, then rename: readers see all of it or none of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes the file 0600; an output is as readable as the umask says
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        if exc.filename is None:  # a failed write names no file: name the one it was for
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process's umask (reading it means setting it, so it is set straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


# --- strict JSON out -----------------------------------------------------------------------------------------------


def finite(value: Any) -> Any:
    """`value` with every float that is not finite (NaN, +-inf) turned into None, through dicts, lists and tuples."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def json_text(obj: Any, indent: int | None = None, sort_keys: bool = False, ensure_ascii: bool = True) -> str:
    """`obj` as strict JSON text: non-finite floats become null, and anything else JSON has no word for raises."""
    return json.dumps(finite(obj), indent=indent, sort_keys=sort_keys, ensure_ascii=ensure_ascii, allow_nan=False)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json_text(obj, indent=2) + "\n")


def atomic_write_jsonl(path: Path, rows: Iterable[Any], ensure_ascii: bool = True) -> None:
    """JSON Lines, one strict JSON value a line, written atomically."""
    atomic_write_text(path, "".join(json_text(row, ensure_ascii=ensure_ascii) + "\n" for row in rows))


# --- text in ---------------------------------------------------------------------------------------------------------

REDO = "delete it to redo the stage that wrote it"  # what to do about a run folder's own file that does not read


def read_text(path: Path, fix: str = "save the file as UTF-8") -> str:
    """A text file decoded as UTF-8; a byte that is not UTF-8 is an error naming the file and the line it is on."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - data.rfind(b"\n", 0, exc.start)
        raise ValueError(f"{_not_utf8(path, line, column, exc)}; {fix}") from exc


def _not_utf8(path: Path, line: int, column: int, exc: UnicodeDecodeError) -> str:
    return f"{path}:{line}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at column {column}: {exc.reason})"


def read_jsonl(path: Path, fix: str = "fix or remove that line") -> Iterator[tuple[int, Any]]:
    """(line number, value) of every non-blank line of a JSON Lines file, read a line at a time. A line that is not
    UTF-8 or not JSON is an error naming the file and line, and ending in `fix`."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                where = _not_utf8(path, line_no, exc.start + 1, exc)
                raise ValueError(f"{where}; save the file as UTF-8, or {fix}") from exc
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({exc.msg}); {fix}") from exc


def read_json(path: Path, fix: str = REDO) -> Any:
    """A JSON file's contents; one that is not UTF-8 or not JSON is an error naming it and ending in `fix`."""
    text = read_text(path, fix)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); {fix}") from exc


def read_json_or_none(path: Path) -> Any:
    """A JSON file's contents, or None when it is missing, unreadable or torn (a note another process may be
    writing or may have left half-written)."""
    try:
        return json.loads(read_text(path))
    except (OSError, ValueError):
        return None


def log_metrics(path: Path, stage: str, **values: Any) -> None:
    """Append one JSON line to the metrics log at `path` (a run folder's logs/metrics.jsonl; rank 0 only). A line is
    one write, so a crash cannot tear it."""
    if rank() != 0:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json_text({"time": round(time.time(), 3), "stage": stage, **values}) + "\n"
    with open(path, "a") as f:
        f.write(line)
