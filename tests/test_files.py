"""common/files.py, the one writer of JSON and the one reader of text: strict JSON out (a figure that is not finite is
null), and every text input's bad byte or bad line named by file and line, through each reader that uses them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from redumix.common.files import (
    atomic_write_json,
    atomic_write_jsonl,
    json_text,
    log_metrics,
    read_json,
    read_jsonl,
    read_text,
)
from redumix.data.jsonl import read_jsonl_by_id
from redumix.pipeline.records import read_records
from redumix.pipeline.studies.drift import read_general_set


def strict_loads(text: str) -> object:
    """json.loads that refuses NaN and the infinities, as jq and JavaScript do."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


NOT_FINITE = {"kl": math.nan, "rows": [1.0, math.inf, {"low": -math.inf, "n": 3}], "pair": (math.nan, 2)}
AS_NULL = {"kl": None, "rows": [1.0, None, {"low": None, "n": 3}], "pair": [None, 2]}


def test_every_writer_turns_figures_that_are_not_finite_into_null(tmp_path):
    assert strict_loads(json_text(NOT_FINITE)) == AS_NULL
    atomic_write_json(tmp_path / "m.json", NOT_FINITE)
    assert strict_loads((tmp_path / "m.json").read_text()) == AS_NULL
    atomic_write_jsonl(tmp_path / "r.jsonl", [NOT_FINITE, {"x": math.nan}])
    assert [strict_loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()] == [AS_NULL, {"x": None}]
    log_metrics(tmp_path / "logs" / "metrics.jsonl", "train", loss=math.nan, step=1)
    logged = strict_loads((tmp_path / "logs" / "metrics.jsonl").read_text())
    assert logged["loss"] is None and logged["step"] == 1 and logged["stage"] == "train"


def test_what_json_cannot_hold_is_still_an_error():
    with pytest.raises(TypeError):
        json_text({"path": Path("x")})


def _latin1(tmp_path: Path, name: str, lines: list[str], bad_line: int) -> Path:
    """A UTF-8 file (with a multi-byte character before the bad one) whose line `bad_line` holds 'é' in Latin-1."""
    data = b""
    for number, line in enumerate(lines, start=1):
        encoded = line.encode()
        data += (encoded.replace("café".encode(), b"caf\xe9") if number == bad_line else encoded) + b"\n"
    path = tmp_path / name
    path.write_bytes(data)
    return path


LINES = ['{"question": "Über 2 + 2?", "answer": "#### 4"}', '{"question": "2 + 3?", "answer": "#### 5"}',
         '{"question": "café 3 + 3?", "answer": "#### 6"}']


@pytest.mark.parametrize("bad_line", [1, 3])
def test_a_byte_that_is_not_utf8_is_named_by_file_line_and_column(tmp_path, bad_line):
    lines = [line.replace("Über", "café") if bad_line == 1 and i == 0 else line for i, line in enumerate(LINES)]
    path = _latin1(tmp_path, "t.jsonl", lines, bad_line)
    column = lines[bad_line - 1].encode().index("café".encode()) + 4  # the byte after "caf", 1-based
    where = f"{path}:{bad_line}: not UTF-8 text (byte 0xe9 at column {column}: invalid continuation byte)"
    with pytest.raises(ValueError) as whole:
        read_text(path)
    assert str(whole.value) == f"{where}; save the file as UTF-8"
    with pytest.raises(ValueError) as by_line:
        list(read_jsonl(path))
    assert str(by_line.value) == f"{where}; save the file as UTF-8, or fix or remove that line"


def test_every_text_reader_names_the_bad_byte(tmp_path):
    """The drift general set, a feedback file, eval's records and a run folder's JSON: each one names file and line."""
    general = _latin1(tmp_path, "general.jsonl", LINES, 3)
    with pytest.raises(ValueError, match=rf"{general}:3: not UTF-8 text \(byte 0xe9"):
        read_general_set(general, 5)
    lines = ['{"id": "a", "feedback": "ok"}', '{"id": "b", "feedback": "café"}']
    feedback = _latin1(tmp_path, "feedback.jsonl", lines, 2)
    with pytest.raises(ValueError, match=rf"{feedback}:2: not UTF-8 text"):
        read_jsonl_by_id(feedback, "feedback")
    records = _latin1(tmp_path, "base--greedy.jsonl", ['{"id": "a"}', '{"id": "café"}'], 2)
    with pytest.raises(ValueError, match=rf"{records}:2: not UTF-8 text .*; save the file as UTF-8, or delete it to "
                                         "redo the stage that wrote it"):
        read_records(records)
    manifest = _latin1(tmp_path, "manifest.json", ["{", '  "name": "café"', "}"], 2)
    with pytest.raises(ValueError, match=rf"{manifest}:2: not UTF-8 text .*; delete it to redo the stage that"):
        read_json(manifest)


def test_a_line_that_is_not_json_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"a": 1}\n\n{"a": \n')
    with pytest.raises(ValueError, match=rf"{path}:3: not valid JSON \(Expecting value\); fix or remove that line"):
        list(read_jsonl(path))
    assert next(read_jsonl(path)) == (1, {"a": 1})  # the lines before it read


def test_line_numbers_count_newlines_only(tmp_path):
    """A JSON string may hold U+2028 (an export written with ensure_ascii=False does): it is not a line break."""
    path = tmp_path / "sft.jsonl"
    atomic_write_jsonl(path, [{"text": "one\u2028two"}, {"text": "three"}], ensure_ascii=False)
    assert list(read_jsonl(path)) == [(1, {"text": "one\u2028two"}), (2, {"text": "three"})]
