"""One ingest's rows of one catalog table, staged on disk as its partitions finish, and the
commit that streams them into the table.

An ingest decodes in partitions; each partition's rows go to a Parquet file of their own in a
staging folder as soon as the partition is done, so the driver holds one partition's rows at a
time, however many items the ingest decodes.

`commit_staged` then writes the table's data files itself, a row group at a time (delta-rs
buffers every row of a write into a partitioned table until it commits, about 300 bytes a row),
and commits them with delta-rs's transaction API in one commit that also removes the rows they
replace: each older data file that holds such rows is rewritten without them (copy on write,
as Delta's own delete does), and the commit adds the new files and removes the old ones.
"""

from __future__ import annotations

import json
import math
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable
from deltalake import Schema as DeltaSchema
from deltalake._internal import RemoveAction
from deltalake.transaction import AddAction

from tasks.catalog.view import (
    ROW_GROUP,
    SEQ,
    conform,
    frame_rows,
    open_table,
    table_path,
    target_schema,
    untyped_nulls,
)
from tasks.storage.layout import Layout

__all__ = ["FILE_ROWS", "Replaced", "StagedRows", "commit_staged"]

FILE_ROWS = 16 * ROW_GROUP  # rows per data file an ingest writes (about a million)


class StagedRows:
    """Rows of one table, added a partition at a time to Parquet files under `folder`.

    Args:
        folder: The staging folder (created; `discard` removes it).
        columns: The columns every staged frame starts with (absent ones null).
    """

    def __init__(self, folder: Path, columns: list[str]) -> None:
        self.folder, self.columns = folder, columns
        self.rows = 0
        self._files: list[Path] = []
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)

    def add(self, records: list[dict]) -> None:
        """Stage `records` (dicts of column values) as one file, sorted by key."""
        if not records:
            return
        df = frame_rows(records, self.columns)
        t = untyped_nulls(pa.Table.from_pandas(df, preserve_index=False))
        path = self.folder / f"part-{len(self._files):06d}.parquet"
        pq.write_table(t, path, row_group_size=ROW_GROUP)
        self._files.append(path)
        self.rows += t.num_rows

    def schema(self, dt: DeltaTable | None) -> pa.Schema:
        """The staged columns (and `ingest_seq`), typed as the table `dt` has them."""
        schemas = [pq.read_schema(p) for p in self._files]
        return target_schema([*schemas, pa.schema([(SEQ, pa.int64())])], dt)

    def tables(self, schema: pa.Schema) -> Iterator[pa.Table]:
        """The staged rows in the order they were added, a row group at a time, of `schema`
        (which has no `ingest_seq`: the partition holds it)."""
        for path in self._files:
            f = pq.ParquetFile(path)
            for g in range(f.num_row_groups):
                yield conform(f.read_row_group(g), schema)

    def discard(self) -> None:
        """Remove the staging folder."""
        shutil.rmtree(self.folder, ignore_errors=True)


@dataclass(frozen=True)
class Replaced:
    """The rows of `source` an ingest replaces: those of its replaced units, and any of
    `steps`. `units(lo, hi)` gives the replaced units from `lo` to `hi` (None: no bound), so
    that a data file is checked against the units in its own range, never all of them."""

    source: str
    units: Callable[[str | None, str | None], pa.Array]
    steps: tuple[str, ...] = ()

    def mask(self, t: pa.Table, units: pa.Array) -> pa.ChunkedArray:
        """Which rows of `t` (with `source`, `unit` and, for `steps`, `step`) are replaced,
        given the replaced `units` of its range."""
        hit = pc.is_in(t.column("unit"), value_set=units)
        if self.steps:
            hit = pc.or_(hit, pc.is_in(t.column("step"), value_set=pa.array(self.steps)))
        return pc.fill_null(pc.and_(pc.equal(t.column("source"), self.source), hit), False)

    def in_range(self, act: dict) -> pa.Array | None:
        """The replaced units a data file (its add action, flattened) may hold, by its
        statistics; None when it holds no replaced row (it is not read)."""
        lo, hi = act.get("min.source"), act.get("max.source")
        if lo is not None and hi is not None and not lo <= self.source <= hi:
            return None
        units = self.units(act.get("min.unit"), act.get("max.unit"))
        return units if len(units) or self.steps else None


def commit_staged(
    layout: Layout, table: str, staged: StagedRows, seq: int, replaced: Replaced
) -> int | None:
    """Commit the staged rows to `table` as ingest `seq`, and remove the `replaced` rows, in
    one commit. Returns the table's version after it (None: the table is still empty)."""
    dt = open_table(layout, table)
    if dt is None and not staged.rows:
        return None
    schema = staged.schema(dt)
    root = table_path(layout, table)
    if dt is None:
        dt = DeltaTable.create(str(root), schema, partition_by=[SEQ])
    elif _add_columns(dt, schema):
        dt = open_table(layout, table)
    data = schema.remove(schema.get_field_index(SEQ))
    adds: list[AddAction] = []
    removes, rewritten = [], []
    try:
        adds = _write_files(root, seq, staged.tables(data), data) if staged.rows else []
        for act in pa.table(dt.get_add_actions(flatten=True)).to_pylist():
            old_seq = int(act[f"partition.{SEQ}"])
            units = None if old_seq == seq else replaced.in_range(act)
            if old_seq != seq and units is None:
                continue
            kept = None if old_seq == seq else _rewrite(root, act, old_seq, replaced, units)
            if kept is False:  # no replaced row in it
                continue
            removes.append(
                RemoveAction(act["path"], True, _now_ms(), act["size_bytes"], {SEQ: str(old_seq)})
            )
            rewritten += kept or []
        if not adds and not removes:
            return dt.version()
        dt.create_write_transaction(
            [*adds, *rewritten, *removes], mode="append", schema=schema, partition_by=[SEQ]
        )
    except BaseException:
        _remove_files(root, [a.path for a in (*adds, *rewritten)])  # no version names them
        raise
    return open_table(layout, table).version()


def _add_columns(dt: DeltaTable, schema: pa.Schema) -> bool:
    """Give the table the columns of `schema` it lacks (a commit of its own, which changes no
    row); whether it lacked any."""
    have = set(pa.schema(dt.schema().to_arrow()).names)
    new = [f for f in schema if f.name not in have]
    if new:
        dt.alter.add_columns(DeltaSchema.from_arrow(pa.schema(new)).fields)
    return bool(new)


def _write_files(
    root: Path, seq: int, tables: Iterator[pa.Table], schema: pa.Schema
) -> list[AddAction]:
    """Write `tables` into partition `seq` of the table at `root`, in row groups of `ROW_GROUP`
    rows (small tables are gathered) and `FILE_ROWS` rows a file."""
    adds, writer, rel, rows, held, written = [], None, "", 0, [], []

    def flush(final: bool) -> None:
        nonlocal writer, rel, rows, held
        while held and (final or sum(t.num_rows for t in held) >= ROW_GROUP):
            t = pa.concat_tables(held)
            group, rest = t.slice(0, ROW_GROUP), t.slice(ROW_GROUP)
            held = [rest] if rest.num_rows else []
            if writer is None:
                rel = f"{SEQ}={seq}/part-{uuid.uuid4()}.snappy.parquet"
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                written.append(rel)
                writer = pq.ParquetWriter(root / rel, schema, compression="snappy")
            writer.write_table(group, row_group_size=ROW_GROUP)
            rows += group.num_rows
            if rows >= FILE_ROWS or (final and not held):
                writer.close()
                adds.append(_add_action(root, rel, seq))
                writer, rows = None, 0

    try:
        for t in tables:
            held.append(t)
            flush(final=False)
        flush(final=True)
    except BaseException:
        if writer is not None:
            writer.close()
        _remove_files(root, written)
        raise
    return adds


def _remove_files(root: Path, paths: list[str]) -> None:
    """Delete data files (paths relative to the table) that no version names."""
    for rel in paths:
        (root / rel).unlink(missing_ok=True)


def _rewrite(
    root: Path, act: dict, seq: int, replaced: Replaced, units: pa.Array
) -> list[AddAction] | bool:
    """The data file of `act` without its `replaced` rows (`units`: the replaced units of its
    range): False when it holds none, else the add action of its rewrite (none when no row is
    left)."""
    f = pq.ParquetFile(root / unquote(act["path"]))
    need = [c for c in ("source", "unit", "step") if c in f.schema_arrow.names]
    masks = [
        replaced.mask(f.read_row_group(g, columns=need), units) for g in range(f.num_row_groups)
    ]
    if not any(pc.any(m).as_py() for m in masks):
        return False
    tables = (f.read_row_group(g).filter(pc.invert(m)) for g, m in enumerate(masks))
    return _write_files(root, seq, (t for t in tables if t.num_rows), f.schema_arrow)


def _add_action(root: Path, rel: str, seq: int) -> AddAction:
    path = root / rel
    stats = json.dumps(_stats(pq.ParquetFile(path).metadata), allow_nan=False)
    return AddAction(rel, path.stat().st_size, {SEQ: str(seq)}, _now_ms(), True, stats)


def _stats(meta: pq.FileMetaData) -> dict:
    """Delta's file statistics (row count, per-column min, max and null count) from the file's
    Parquet footer, for the flat string, integer, float and boolean columns (a float's min
    and max only when finite: JSON has no NaN or infinity)."""
    out = {"numRecords": meta.num_rows, "minValues": {}, "maxValues": {}, "nullCount": {}}
    arrow = meta.schema.to_arrow_schema()
    leaf = {meta.schema.column(j).path: j for j in range(len(meta.schema))}
    for field in arrow:
        t, j = field.type, leaf.get(field.name)
        if j is None or not (
            pa.types.is_string(t)
            or pa.types.is_large_string(t)
            or pa.types.is_integer(t)
            or pa.types.is_floating(t)
            or pa.types.is_boolean(t)
        ):
            continue
        cols = [meta.row_group(g).column(j).statistics for g in range(meta.num_row_groups)]
        if any(s is None for s in cols):
            continue
        out["nullCount"][field.name] = sum(s.null_count for s in cols)
        vals = [(s.min, s.max) for s in cols if s.has_min_max]
        if vals and len(vals) == sum(1 for s in cols if s.num_values):
            lo, hi = min(v[0] for v in vals), max(v[1] for v in vals)
            if not any(isinstance(v, float) and not math.isfinite(v) for v in (lo, hi)):
                out["minValues"][field.name], out["maxValues"][field.name] = lo, hi
    return out


def _now_ms() -> int:
    return int(time.time() * 1000)
