"""The verdict's rows against the catalog: duplicate hits resolved to the view's rows, the
quarantine of the whole view, and the verdict's Delta tables.

`resolve_hits` turns the duplicate search's hits (numpy positions) into rows with one scan of
the view's keys and a DuckDB join; `write_quarantine` sorts the quarantine on disk
(`data_quality.external_sort`) and counts it; `write_verdict_table` streams a verdict file into
its Delta table. DuckDB runs with `DUCKDB_MEMORY` and one thread, and spills the rest to the
staging folder. The rows themselves are written as `data_quality.verdict_rows` streams them.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import write_deltalake

from data_quality.external_sort import merged_tables, sorted_tables
from data_quality.suite import SAMPLE
from data_quality.verdict_rows import (
    BATCH_ROWS,
    FLAG_SCHEMA,
    RANK,
    REJECT_SCHEMA,
    atomic_writer,
    base_rows,
    conform,
    empty_file,
    ranked,
    string_array,
    verdict_rank,
)
from tasks.catalog.view import (
    VERDICT_TABLES,
    ViewPart,
    open_table,
    read_part,
    sql_str,
    table_path,
    view_parts,
    writer_properties,
)
from tasks.storage.layout import Layout

__all__ = [
    "DUCKDB_MEMORY",
    "quarantine_schema",
    "resolve_hits",
    "write_quarantine",
    "write_verdict_table",
]

DUCKDB_MEMORY = "256MB"  # DuckDB's share of the driver; its sorts and joins spill past it
_KEYS = pa.schema([("pos", pa.int64()), ("source", pa.string()), ("key", pa.string())])


def _duckdb(stage: Path):
    """A DuckDB connection of DUCKDB_MEMORY and one thread, spilling under `stage`: with more
    threads, an ordered COPY to Parquet runs out of memory where one thread spills."""
    con = duckdb.connect()
    spill = stage / "duckdb-spill"
    spill.mkdir(parents=True, exist_ok=True)
    con.execute(f"SET memory_limit = '{DUCKDB_MEMORY}'")
    con.execute(f"SET temp_directory = {sql_str(str(spill))}")
    con.execute("SET threads = 1")
    return con


def _hit_keys(parts: list[ViewPart], need: np.ndarray, path: Path) -> None:
    """(pos, source, key) of the view's rows at the sorted positions `need`, to `path`, read
    a row group at a time (row groups without one are skipped from their metadata)."""
    start = 0
    with pq.ParquetWriter(path, _KEYS) as writer:
        for p in parts:
            meta = pq.ParquetFile(p.path).metadata
            for g in range(p.row_groups):
                n = meta.row_group(g).num_rows
                lo, hi = np.searchsorted(need, [start, start + n])
                if hi > lo:
                    at = need[lo:hi]
                    df = read_part(p, ["source", "key"], [g])
                    writer.write_table(
                        pa.table(
                            {
                                "pos": pa.array(at, pa.int64()),
                                "source": string_array(df["source"].to_numpy(object)[at - start]),
                                "key": string_array(df["key"].to_numpy(object)[at - start]),
                            },
                            schema=_KEYS,
                        )
                    )
                start += n
                if hi >= len(need):
                    return


def resolve_hits(
    parts: list[ViewPart], hits: dict, drop_near: bool, stage: Path
) -> tuple[Path, Path]:
    """The duplicate hits (`data_quality.suite.cross_hits`) as rows: the exact copies, then
    the near-duplicates when `drop_near`, to `stage/cross-rejects.parquet` (source, key,
    reason, detail), else the near-duplicates to `stage/cross-flags.parquet` (source, key,
    near_duplicate_of), each in the order of the hit positions. Returns both paths."""
    rejects, flags = stage / "cross-rejects.parquet", stage / "cross-flags.parquet"
    (dup_pos, dup_of), (near_pos, near_of) = hits["dup"], hits["near"]
    if not len(dup_pos) + len(near_pos):
        return empty_file(rejects, REJECT_SCHEMA), empty_file(flags, FLAG_SCHEMA)
    keys = stage / "hit-keys.parquet"
    _hit_keys(parts, np.unique(np.concatenate([dup_pos, dup_of, near_pos, near_of])), keys)
    con = _duckdb(stage)
    try:
        hit_table = pa.table(
            {
                "ord": np.arange(len(dup_pos) + len(near_pos), dtype=np.int64),
                "pos": np.concatenate([dup_pos, near_pos]).astype(np.int64),
                "of": np.concatenate([dup_of, near_of]).astype(np.int64),
                "near": np.r_[np.zeros(len(dup_pos), bool), np.ones(len(near_pos), bool)],
            }
        )
        con.register("hits", hit_table)
        con.execute(f"CREATE VIEW keys AS SELECT * FROM read_parquet({sql_str(str(keys))})")
        joined = (
            "FROM hits h JOIN keys k ON k.pos = h.pos JOIN keys o ON o.pos = h.of {} ORDER BY h.ord"
        )
        uid = "rtrim(o.source, '/') || '/' || o.key"
        detail = f"CASE WHEN h.near THEN 'pHash near ' ELSE 'same sha256 as ' END || {uid}"
        reason = "CASE WHEN h.near THEN 'near_duplicate' ELSE 'duplicate_sha256' END"
        where = "" if drop_near else "WHERE NOT h.near"
        con.execute(
            f"COPY (SELECT k.source, k.key, {reason} AS reason, {detail} AS detail "
            f"{joined.format(where)}) TO {sql_str(str(rejects))} "
            "(FORMAT parquet)"
        )
        if drop_near:
            empty_file(flags, FLAG_SCHEMA)
        else:
            con.execute(
                f"COPY (SELECT k.source, k.key, {uid} AS near_duplicate_of "
                f"{joined.format('WHERE h.near')}) TO {sql_str(str(flags))} "
                "(FORMAT parquet)"
            )
    finally:
        con.close()
    return rejects, flags


def quarantine_schema(parts: list[ViewPart]) -> pa.Schema:
    """The quarantine's columns: the ingest quarantine files', `ingest_seq`, then this step's."""
    fields: dict[str, pa.DataType] = {}
    for p in parts:
        for f in pq.read_schema(p.path):
            fields.setdefault(f.name, pa.string() if pa.types.is_null(f.type) else f.type)
    if parts:
        fields["ingest_seq"] = pa.int64()
    for c in (*REJECT_SCHEMA.names, "step", "ingest_id"):
        fields.setdefault(c, pa.string())
    return pa.schema(list(fields.items()))


def _quarantine_rows(
    parts: list[ViewPart], rejects: Path, ingest_id: str, schema: pa.Schema
) -> Iterator[pa.Table]:
    for p in parts:
        for b in pq.ParquetFile(p.path).iter_batches(batch_size=BATCH_ROWS):
            t = pa.Table.from_batches([b])
            t = t.drop_columns([c for c in ("ingest_seq",) if c in t.column_names])
            yield conform(
                t.append_column("ingest_seq", pa.array([p.seq] * len(t), pa.int64())), schema
            )
    for b in pq.ParquetFile(rejects).iter_batches(batch_size=BATCH_ROWS):
        n = b.num_rows
        t = pa.Table.from_batches([b]).append_column("step", pa.array(["validate"] * n))
        yield conform(t.append_column("ingest_id", pa.array([ingest_id] * n)), schema)


def write_quarantine(
    layout: Layout,
    ingest_id: str,
    rejects: Path,
    qdir: Path,
    *,
    base: Path | None = None,
    after_seq: int = 0,
    parts: list[ViewPart] | None = None,
) -> pd.DataFrame:
    """Every quarantined row of the view, the ingest's (`ingest_seq` from its partition) and
    this step's rejects (`step` "validate"), sorted by source and key (ties in that order; a
    sort on disk, data_quality/external_sort.py), to `qdir/quarantine.parquet`; up to SAMPLE
    rows a reason of it to `quarantine_sample.parquet`. Returns its rows counted by step and
    reason (`step`, `reason`, `n`), in order of each pair's first row.

    With `base`, an earlier verdict's quarantine file (of the view up to ingest `after_seq`,
    checked by `merge_base`), `rejects` holds only the rows this step adds to that verdict's:
    the ingest rows after `after_seq` and `rejects` are sorted and merged with `base`, which
    writes the file a rebuild would (the caller checks that the view's quarantine up to
    `after_seq` and the licensing terms' rows are those `base` was built from). `parts`:
    the view's quarantine parts, when the caller has them."""
    parts = view_parts(layout, ingest_id, "quarantine") if parts is None else parts
    schema = quarantine_schema(parts)
    out, sample = qdir / "quarantine.parquet", qdir / "quarantine_sample.parquet"
    runs = qdir.parent / f".{qdir.name}-sort"
    counts: dict[tuple, int] = {}
    kept: dict[str, int] = {}
    picked = []
    writer, tmp = atomic_writer(out, schema)
    try:
        with writer:
            if base is None:
                rows = sorted_tables(
                    _quarantine_rows(parts, rejects, ingest_id, schema), ["source", "key"], runs
                )
            else:
                new = [p for p in parts if p.seq > after_seq]
                added = sorted_tables(
                    _quarantine_rows(new, rejects, ingest_id, schema), ["source", "key"], runs
                )
                # Ties keep a rebuild's order: ingest rows (older ingests first), then
                # the validate step's (the earlier verdict's first).
                rows = merged_tables(
                    [base_rows(base, ingest_id, schema), ranked(added, verdict_rank)],
                    ["source", "key"],
                    RANK,
                )
            for t in rows:
                writer.write_table(t)
                df = t.select(["step", "reason"]).to_pandas().astype(object)
                pairs = df.groupby(["step", "reason"], dropna=False, sort=False).size()
                for pair, n in pairs.items():
                    counts[pair] = counts.get(pair, 0) + int(n)
                why = df["reason"].fillna("")
                seen = why.map(kept).fillna(0).astype(int) + why.groupby(why).cumcount()
                take = df["reason"].notna() & (seen < SAMPLE)
                if take.any():
                    picked.append(t.filter(pa.array(take.to_numpy(bool))))
                for r, n in why.value_counts().items():  # "" counts null reasons: never taken
                    kept[r] = kept.get(r, 0) + int(n)
        tmp.replace(out)
    finally:
        shutil.rmtree(runs, ignore_errors=True)
    pq.write_table(pa.concat_tables(picked) if picked else schema.empty_table(), sample)
    return pd.DataFrame(
        [(s, r, n) for (s, r), n in counts.items()], columns=["step", "reason", "n"]
    )


def write_verdict_table(layout: Layout, table: str, path: Path, ingest_id: str) -> int:
    """Stream the verdict file `path` into the Delta table `table` ("rejects" or "flags")
    with a `verdict` column (`ingest_id`); an earlier verdict on the same ingest leaves in the
    same commit. Returns the table's version after it."""
    if table not in VERDICT_TABLES:
        raise ValueError(f"verdict table must be one of {VERDICT_TABLES}, got {table!r}")
    dt = open_table(layout, table)
    f = pq.ParquetFile(path)
    known = {x.name: x.type for x in pa.schema(dt.schema().to_arrow())} if dt else {}
    fields = [*f.schema_arrow, pa.field("verdict", pa.string())]
    schema = pa.schema([pa.field(x.name, known.get(x.name, pa.string())) for x in fields])

    def batches():
        for b in f.iter_batches(batch_size=BATCH_ROWS):
            t = pa.Table.from_batches([b])
            t = t.append_column("verdict", pa.array([ingest_id] * len(t), pa.string()))
            yield from t.cast(schema).to_batches()

    data = pa.RecordBatchReader.from_batches(schema, batches())
    if dt is None:
        write_deltalake(str(table_path(layout, table)), data, writer_properties=writer_properties())
    else:
        write_deltalake(
            dt,
            data,
            mode="overwrite",
            predicate=f"verdict = {sql_str(ingest_id)}",
            schema_mode="merge",
            writer_properties=writer_properties(),
        )
    return open_table(layout, table).version()
