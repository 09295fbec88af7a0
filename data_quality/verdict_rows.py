"""The validate step's verdict rows, written as they are found and streamed into place.

A validate of a large catalog quarantines or flags a tenth of its rows or more. None of
them is held on the driver: each check partition writes its rejects to a staging Parquet
file (`stage_rejects`); `write_rows` streams the earlier verdict's rows, the staged ones and
the licensing terms' into `rejects.parquet` and `near_duplicates.parquet`; `merge_base` says
whether an earlier verdict's quarantine file can be merged into rather than rebuilt, and
`base_rows`, `ranked` and `verdict_rank` order such a merge's rows as a rebuild would. The
catalog's side of the verdict (the hits resolved to rows, the quarantine of the view, the
Delta tables) is `tasks.quality.verdict_tables`'.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

__all__ = [
    "BATCH_ROWS",
    "FLAG_SCHEMA",
    "RANK",
    "REJECT_SCHEMA",
    "atomic_writer",
    "base_rows",
    "conform",
    "empty_file",
    "merge_base",
    "ranked",
    "stage_rejects",
    "string_array",
    "verdict_rank",
    "write_rows",
]

BATCH_ROWS = 65_536  # rows per batch streamed from a file to another
REJECT_SCHEMA = pa.schema([(c, pa.string()) for c in ("source", "key", "reason", "detail")])
FLAG_SCHEMA = pa.schema([(c, pa.string()) for c in ("source", "key", "near_duplicate_of")])
RANK = "__rank"  # the order of a merge's tied rows (`write_quarantine`)


def string_array(values) -> pa.Array:
    return pa.array([None if v is None else str(v) for v in values], pa.string())


def atomic_writer(path: Path, schema: pa.Schema) -> tuple[pq.ParquetWriter, Path]:
    tmp = path.with_name(path.name + ".tmp")
    return pq.ParquetWriter(tmp, schema), tmp


def stage_rejects(path: str | Path, rejected: pd.DataFrame) -> pd.DataFrame:
    """Write a partition's rejects (source, key, reason, detail) to `path`; return their
    positions alone (`pos`), which is what the driver keeps. A retry rewrites the file."""
    table = pa.table(
        {c: string_array(rejected[c].to_numpy(object)) for c in REJECT_SCHEMA.names},
        schema=REJECT_SCHEMA,
    )
    writer, tmp = atomic_writer(Path(path), REJECT_SCHEMA)
    with writer:
        writer.write_table(table)
    tmp.replace(path)
    return rejected[["pos"]].astype({"pos": np.int64})


def empty_file(path: Path, schema: pa.Schema) -> Path:
    pq.write_table(schema.empty_table(), path)
    return path


def _batches(pieces: Iterable, schema: pa.Schema) -> Iterator[pa.Table]:
    """Each piece (a Parquet path, or a frame) as tables of `schema`, BATCH_ROWS at most."""
    for piece in pieces:
        if isinstance(piece, pd.DataFrame):
            if len(piece):
                yield pa.table(
                    {c: string_array(piece[c].to_numpy(object)) for c in schema.names},
                    schema=schema,
                )
            continue
        f = pq.ParquetFile(piece)
        for batch in f.iter_batches(batch_size=BATCH_ROWS, columns=schema.names):
            yield pa.Table.from_batches([batch]).cast(schema)


def write_rows(
    path: Path,
    pieces: Iterable,
    schema: pa.Schema,
    *,
    gone: pa.Array | None = None,
    drop_reasons: Iterable[str] = (),
    then: Iterable = (),
) -> int:
    """Stream `pieces` (Parquet paths and frames, in order) into the Parquet file `path`,
    leaving out rows whose `reason` is in `drop_reasons` and rows whose source and key
    (joined by a NUL) are in `gone`, then the pieces of `then` whole; written atomically.
    Returns the rows written."""
    drop = pa.array(sorted(drop_reasons), pa.string())
    writer, tmp = atomic_writer(path, schema)
    rows = 0
    with writer:
        for t in _batches(pieces, schema):
            keep = None
            if len(drop):
                keep = pc.invert(pc.fill_null(pc.is_in(t["reason"], value_set=drop), False))
            if gone is not None and len(gone):
                uid = pc.binary_join_element_wise(t["source"], t["key"], "\0")
                out = pc.fill_null(pc.is_in(uid, value_set=gone), False)
                keep = pc.invert(out) if keep is None else pc.and_(keep, pc.invert(out))
            if keep is not None:
                t = t.filter(keep)
            writer.write_table(t)
            rows += t.num_rows
        for t in _batches(then, schema):
            writer.write_table(t)
            rows += t.num_rows
    tmp.replace(path)
    return rows


def conform(t: pa.Table, schema: pa.Schema) -> pa.Table:
    cols = [
        t[f.name].cast(f.type) if f.name in t.column_names else pa.nulls(len(t), f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(cols, schema=schema)


def base_rows(path: Path, ingest_id: str, schema: pa.Schema) -> Iterator[pa.Table]:
    """An earlier verdict's quarantine file as rows of this one: its validate rows under
    `ingest_id`, and `RANK` (0 for the ingest's rows, 2 for the validate step's)."""
    for b in pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS):
        t = conform(pa.Table.from_batches([b]), schema)
        mine = pc.fill_null(pc.equal(t["step"], "validate"), False)
        at = schema.get_field_index("ingest_id")
        mine_id = pa.scalar(ingest_id, schema.field(at).type)
        t = t.set_column(at, schema.field(at), pc.if_else(mine, mine_id, t["ingest_id"]))
        yield t.append_column(RANK, pc.multiply(mine.cast(pa.int8()), 2))


def ranked(tables: Iterable[pa.Table], rank) -> Iterator[pa.Table]:
    """`tables` with `RANK`: `rank(t)` (1 for the new ingests' rows, 3 for the validate's)."""
    for t in tables:
        yield t.append_column(RANK, rank(t))


def verdict_rank(t: pa.Table) -> pa.Array:
    mine = pc.fill_null(pc.equal(t["step"], "validate"), False).cast(pa.int8())
    return pc.add(pc.multiply(mine, 2), pa.scalar(1, pa.int8()))


def merge_base(base: Path, schema: pa.Schema) -> bool:
    """Whether an earlier verdict's quarantine file `base` can be merged with the rows after
    it (`write_quarantine`): it is there, and its columns keep their types in `schema`
    (`quarantine_schema` of the view's quarantine parts)."""
    if not base.is_file():
        return False
    have = pq.read_schema(base)
    return all(f.name in schema.names and schema.field(f.name).type == f.type for f in have)
