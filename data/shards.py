"""Harvest shards: Arrow IPC stream files, zstd-compressed (level 6), one row per task example.

`datasets.load_dataset("arrow", data_files=...)` reads them as they are. Top-k log-probs are stored as float16:
at k=32 that halves the dominant column, and their rounding (relative 2**-11 per probability) costs a KL far below
1e-4. The mass outside the top-k is stored apart, as a float32 log per token (`mix_tail_logprob`) computed from
the full p_mix at harvest time: recovering it as 1 − Σ exp(float16) loses it when it is small (bench/ measures both).
Shards written before that column existed still load; the loss then falls back to 1 − Σp. The harvest writes each
shard under a temporary name and renames it, so a shard file that exists is complete.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from redumix.common.files import json_text

SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("task", pa.string()),
        ("prompt", pa.string()),
        ("reference", pa.string()),
        ("original", pa.string()),
        ("original_correct", pa.bool_()),
        ("feedback", pa.string()),
        ("reflection", pa.string()),
        ("redo", pa.string()),
        ("redo_correct", pa.bool_()),
        ("redo_token_ids", pa.list_(pa.int32())),
        ("mix_topk_ids", pa.list_(pa.list_(pa.int32()))),
        ("mix_topk_logprobs", pa.list_(pa.list_(pa.float16()))),
        ("mix_tail_logprob", pa.list_(pa.float32())),
        ("lam", pa.float32()),
        # x2's ids as the harvest cached them, so on-policy training recomputes the teacher from the same context.
        ("x2_token_ids", pa.list_(pa.int32())),
        ("meta", pa.string()),
    ]
)
COLUMNS = SCHEMA.names
# Level 6 rather than Arrow's default 1: about a seventh fewer bytes per redo token on the tiny recipe's harvest, for
# CPU time that is negligible next to decoding (docs/measurements.md, "Shard compression").
ZSTD_LEVEL = 6
OPTIONAL_COLUMNS = {"mix_tail_logprob", "x2_token_ids"}  # absent from shards of earlier versions (still readable)


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.arrow"


def encode_shard(rows: list[dict]) -> bytes:
    """The bytes of a shard file holding `rows` (dicts with every schema column; `meta` may be a dict).

    An optional column that no row has is left out, as shards of earlier versions lack it.
    """
    schema = pa.schema([f for f in SCHEMA if f.name not in OPTIONAL_COLUMNS or any(f.name in r for r in rows)])
    missing = {c for c in schema.names for r in rows if c not in r}
    if missing:
        raise ValueError(f"shard rows lack columns {sorted(missing)}")
    columns = {c: [r[c] for r in rows] for c in schema.names}
    columns["meta"] = [m if isinstance(m, str) else json_text(m, sort_keys=True) for m in columns["meta"]]
    table = pa.table(columns, schema=schema)
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression=pa.Codec("zstd", compression_level=ZSTD_LEVEL))
    with pa.ipc.new_stream(sink, schema, options=options) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def read_shard(path: Path) -> pa.Table:
    try:
        with pa.OSFile(str(path), "rb") as f:
            table = pa.ipc.open_stream(f).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        raise ValueError(
            f"{path}: not a readable Arrow shard ({exc}); delete it and rerun the harvest to redo it"
        ) from exc
    check_table(table, path)
    return table


_REDO_AGAIN = "delete it and run `redumix harvest` again, which redoes only the missing shards"
_PER_TOKEN = ("mix_topk_ids", "mix_topk_logprobs", "mix_tail_logprob")  # one entry per token of redo_token_ids


def check_table(table: pa.Table, path: Path) -> None:
    """A shard's columns, their types, and one teacher entry per redo token; errors name the file and the fix."""
    missing = [c for c in COLUMNS if c not in table.column_names and c not in OPTIONAL_COLUMNS]
    if missing:
        raise ValueError(f"{path}: missing columns {missing}; it was not written by this version of redumix: "
                         + _REDO_AGAIN)
    for name in table.column_names:
        if name in COLUMNS and table.schema.field(name).type != SCHEMA.field(name).type:
            raise ValueError(
                f"{path}: column {name!r} holds {table.schema.field(name).type}, not "
                f"{SCHEMA.field(name).type}; it was not written by this version of redumix: " + _REDO_AGAIN
            )
    if "redo_token_ids" not in table.column_names or table.num_rows == 0:
        return
    redo = pc.list_value_length(table["redo_token_ids"])
    for name in ("redo_token_ids", *_PER_TOKEN):
        if name not in table.column_names:
            continue
        lengths = pc.list_value_length(table[name])
        wrong = pc.is_null(lengths) if name == "redo_token_ids" else pc.fill_null(pc.not_equal(lengths, redo), True)
        if pc.any(wrong).as_py():
            i = pc.index(wrong, True).as_py()
            row = table["id"][i].as_py() if "id" in table.column_names else i
            have = "no value" if lengths[i].as_py() is None else f"{lengths[i].as_py()} entries"
            than = "" if name == "redo_token_ids" else f" but redo_token_ids has {redo[i].as_py()}"
            raise ValueError(f"{path}: row {row!r}: {name} has {have}{than}; the shard is corrupt: " + _REDO_AGAIN)


def shard_paths(folder: Path) -> list[Path]:
    return sorted(Path(folder).glob("shard-*.arrow"))


def shard_record(path: Path) -> dict:
    """What the manifest keeps of a shard: its row count and the SHA-256 of its bytes."""
    data = Path(path).read_bytes()
    return {"rows": _row_count(path), "sha256": hashlib.sha256(data).hexdigest()}


def _row_count(path: Path) -> int:
    with pa.OSFile(str(path), "rb") as f:
        return sum(batch.num_rows for batch in pa.ipc.open_stream(f))


def bad_shards(folder: Path, records: dict[str, dict]) -> list[str]:
    """Names of the shards in `records` ({name: shard_record}) that are missing or whose bytes changed."""
    bad = []
    for name, expected in records.items():
        path = Path(folder) / name
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != expected["sha256"]:
            bad.append(name)
    return bad


def readable_rows(path: Path) -> int | None:
    """Rows of a shard that reads whole, or None when it is truncated or corrupt."""
    try:
        return _row_count(path)
    except (pa.ArrowInvalid, OSError):
        return None


def load_shards(folder: Path):
    """All shards of a harvest as a `datasets.Dataset` (log-probs come back as float16 lists)."""
    import datasets

    paths = shard_paths(folder)
    if not paths:
        raise FileNotFoundError(f"no shards in {folder}: run `redumix harvest` first")
    for path in paths:
        read_shard(path)  # every column there, with its type and lengths, before anything reads a row
    return datasets.load_dataset("arrow", data_files=[str(p) for p in paths], split="train")


def iter_rows(paths: Iterable[Path]) -> Iterable[dict]:
    for path in paths:
        yield from read_shard(path).to_pylist()
