"""Harvest shards: Arrow IPC stream files, zstd-compressed, one row per task example.

`datasets.load_dataset("arrow", data_files=...)` reads them as they are. Log-probs are stored as float16: at
k=32 that halves the dominant column, and its rounding error (relative 2**-11) keeps the stored distribution far
inside a KL of 1e-4 of the exact one (bench/ measures it). The harvest writes each shard under a temporary name
and renames it, so a shard file that exists is complete.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa

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
        ("lam", pa.float32()),
        ("meta", pa.string()),
    ]
)
COLUMNS = SCHEMA.names


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.arrow"


def encode_shard(rows: list[dict]) -> bytes:
    """The bytes of a shard file holding `rows` (dicts with every schema column; `meta` may be a dict)."""
    missing = {c for c in COLUMNS for r in rows if c not in r}
    if missing:
        raise ValueError(f"shard rows lack columns {sorted(missing)}")
    columns = {c: [r[c] for r in rows] for c in COLUMNS}
    columns["meta"] = [m if isinstance(m, str) else json.dumps(m, sort_keys=True) for m in columns["meta"]]
    table = pa.table(columns, schema=SCHEMA)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, SCHEMA, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
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
    missing = [c for c in COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"{path}: missing columns {missing}; it was not written by this version of redumix")
    return table


def shard_paths(folder: Path) -> list[Path]:
    return sorted(Path(folder).glob("shard-*.arrow"))


def load_shards(folder: Path):
    """All shards of a harvest as a `datasets.Dataset` (log-probs come back as float16 lists)."""
    import datasets

    paths = shard_paths(folder)
    if not paths:
        raise FileNotFoundError(f"no shards in {folder}: run `redumix harvest` first")
    return datasets.load_dataset("arrow", data_files=[str(p) for p in paths], split="train")


def iter_rows(paths: Iterable[Path]) -> Iterable[dict]:
    for path in paths:
        yield from read_shard(path).to_pylist()
