"""The catalog view: every accepted and quarantined row of every source ingested into a root.

The rows live in two Delta Lake tables (delta-rs, the `deltalake` package), which DuckDB,
Polars, Spark or Trino read as they are:

* `<root>/catalog/tables/accepted`: the rows that passed ingest;
* `<root>/catalog/tables/quarantine`: the rows ingest rejected, and each source's manifest
  problems (those of its newest ingest).

Both are partitioned by `ingest_seq`, the ingest that wrote the row, so a file never mixes two
ingests: the view reads oldest ingest first (the earliest ingested copy of anything comes
first), and "the rows added after ingest N" is a partition filter that opens no other file.

An ingest is one commit per table (`write_ingest`): the rows of the units it replaced or found
removed leave in the same commit that adds their replacements (a `replaceWhere` overwrite), so
no reader ever sees both or neither. Its `summary.json` names the table versions it produced
(`table_versions`); the view after an ingest is the tables at those versions (time travel), or
at a later version when only compaction committed since (`surviving_version`).

Reading stays in bounded memory: a `ViewPart` is one data file of the table at a version, and
`read_part` / `scan_view` read it a Parquet row group (`ROW_GROUP` rows) at a time.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable, WriterProperties, write_deltalake

from kiln_config import CATALOG_COLUMNS
from kiln_config.errors import InputError, MissingInput
from tasks.storage.layout import Layout

__all__ = [
    "ACCEPTED_COLUMNS",
    "QUARANTINE_COLUMNS",
    "ROW_GROUP",
    "SEQ",
    "TABLES",
    "VERDICT_TABLES",
    "ViewPart",
    "accepted_columns",
    "chain",
    "conform",
    "declared_columns",
    "frame_rows",
    "open_table",
    "read_part",
    "read_view",
    "surviving_version",
    "scan_view",
    "sql_str",
    "table_path",
    "target_schema",
    "untyped_nulls",
    "view_columns",
    "view_parts",
    "view_versions",
    "write_catalog_dir",
    "write_ingest",
    "writer_properties",
]

ACCEPTED_COLUMNS = CATALOG_COLUMNS
QUARANTINE_COLUMNS = [
    "key",
    "source",
    "reason",
    "detail",
    "step",
    "unit",
    "unit_version",
    "ingest_id",
]
ROW_GROUP = 65_536  # rows per Parquet row group: the unit that scans and partitions read
TABLES = ("accepted", "quarantine")
VERDICT_TABLES = ("rejects", "flags")  # each validate's rejects and kept near-duplicates
SEQ = "ingest_seq"  # the partition column of both tables
_OWN_COLUMNS = {*ACCEPTED_COLUMNS, *QUARANTINE_COLUMNS, SEQ, "verdict"}
_DATA_FREE = {"OPTIMIZE", "VACUUM START", "VACUUM END", "ADD COLUMN"}  # commits of no row


@dataclass(frozen=True)
class ViewPart:
    """One data file of a catalog table: rows of one ingest (`seq`), all in the view."""

    path: Path
    ingest_id: str  # the ingest whose summary named the table version read
    seq: int
    source: str | None  # None when the file's statistics do not name a single source
    rows: int
    row_groups: int


def table_path(layout: Layout, table: str) -> Path:
    """Where the Delta table `table` (of `TABLES` or `VERDICT_TABLES`) of the root lives."""
    if table not in (*TABLES, *VERDICT_TABLES):
        raise ValueError(f"catalog table must be one of {TABLES + VERDICT_TABLES}, got {table!r}")
    return layout.catalog_tables() / table


def open_table(layout: Layout, table: str, version: int | None = None) -> DeltaTable | None:
    """The Delta table at `version` (newest when None); None when no ingest created it."""
    path = table_path(layout, table)
    if not (path / "_delta_log").is_dir():
        return None
    return DeltaTable(str(path)) if version is None else DeltaTable(str(path), version=version)


def chain(layout: Layout, ingest_id: str | None) -> list[dict]:
    """The summaries of the ingests behind `ingest_id`'s view, oldest first (each with `id`)."""
    out = []
    while ingest_id is not None:
        summary = json.loads((layout.catalog(ingest_id) / "summary.json").read_text())
        out.append({**summary, "id": ingest_id})
        ingest_id = summary.get("previous")
    return out[::-1]


def view_versions(layout: Layout, ingest_id: str | None) -> dict[str, int | None]:
    """The table versions the view after `ingest_id` reads (None: the table is empty)."""
    if ingest_id is None:
        return dict.fromkeys(TABLES)
    summary = json.loads((layout.catalog(ingest_id) / "summary.json").read_text())
    if "table_versions" not in summary:
        raise InputError(
            f"catalog {ingest_id} under {layout.root} is in the pre-Delta layout (no "
            "table_versions in its summary.json): run `kiln catalog migrate` once"
        )
    return {t: summary["table_versions"].get(t) for t in TABLES}


def surviving_version(dt: DeltaTable, version: int) -> int:
    """`version`, or the newest later one when every commit since only compacted or vacuumed
    (same rows; the files `version` named may have been vacuumed away)."""
    ops = {h["version"]: h.get("operation") for h in dt.history() if h["version"] > version}
    while ops.get(version + 1) in _DATA_FREE:
        version += 1
    return version


def view_parts(layout: Layout, ingest_id: str | None, table: str = "accepted") -> list[ViewPart]:
    """The data files of `table` ("accepted" or "quarantine") in the view after `ingest_id`,
    oldest ingest first."""
    version = view_versions(layout, ingest_id)[table]
    dt = open_table(layout, table)
    if version is None or dt is None:
        return []
    dt = open_table(layout, table, surviving_version(dt, version))
    acts = pa.table(dt.get_add_actions(flatten=True)).to_pylist()
    root, parts = table_path(layout, table), []
    for a in sorted(
        acts, key=lambda a: (int(a[f"partition.{SEQ}"]), a["modification_time"], a["path"])
    ):
        path = root / unquote(a["path"])
        if not path.is_file():
            raise MissingInput(
                f"catalog view of {ingest_id}: {table} table version {dt.version()} needs "
                f"{path}, which `kiln catalog compact` vacuumed (older than --retain-hours)"
            )
        lo, hi = a.get("min.source"), a.get("max.source")
        meta = pq.ParquetFile(path).metadata  # its own row count: a file's stats may be absent
        parts.append(
            ViewPart(
                path=path,
                ingest_id=ingest_id,
                seq=int(a[f"partition.{SEQ}"]),
                source=lo if lo is not None and lo == hi else None,
                rows=int(meta.num_rows),
                row_groups=meta.num_row_groups,
            )
        )
    return parts


def accepted_columns(
    layout: Layout, ingest_id: str | None, parts: list[ViewPart] | None = None
) -> list[str]:
    """The columns of the accepted rows of the view after `ingest_id` (of `parts`, its data
    files, when given): those of the files, then the declared metadata columns that no row
    has a value for yet (`declared_columns`), which reads give as null."""
    if parts is None:
        parts = view_parts(layout, ingest_id, "accepted")
    names = view_columns(parts) if parts else list(ACCEPTED_COLUMNS)
    return names + [c for c in declared_columns(layout, ingest_id) if c not in names]


def declared_columns(layout: Layout, ingest_id: str | None) -> list[str]:
    """The metadata columns the view's sources were ingested with (`ingest.metadata_columns`),
    whether or not a row has a value yet (a column null everywhere is not in the tables)."""
    if ingest_id is None:
        return []
    summary = json.loads((layout.catalog(ingest_id) / "summary.json").read_text())
    settings = summary.get("source_settings", {}).values()
    return list(dict.fromkeys(c for s in settings for c in s.get("metadata_columns", [])))


def view_columns(parts: list[ViewPart]) -> list[str]:
    """The union of the parts' columns: the catalog's own first, then metadata columns in the
    order they first appear."""
    names: list[str] = []
    for p in parts:
        names += [n for n in (*pq.read_schema(p.path).names, SEQ) if n not in names]
    own = [c for c in (*ACCEPTED_COLUMNS, *QUARANTINE_COLUMNS) if c in names]
    return list(dict.fromkeys(own)) + [n for n in names if n not in own]


def read_part(
    part: ViewPart,
    columns: list[str] | None = None,
    row_groups: list[int] | None = None,
    sources: set[str] | None = None,
) -> pd.DataFrame:
    """The part's rows (of `row_groups` and `sources` only, when given), with `columns`
    (absent ones null; `ingest_seq` from the partition)."""
    f = pq.ParquetFile(part.path)
    have = f.schema_arrow.names
    need = have if columns is None else [c for c in columns if c in have]
    extra = ["source"] if sources is not None and "source" not in need else []
    groups = list(range(f.num_row_groups) if row_groups is None else row_groups)
    t = f.read_row_groups(groups, columns=need + extra) if groups else f.schema_arrow.empty_table()
    if t.num_rows and sources is not None and part.source is None:
        t = t.filter(
            pc.is_in(t.column("source").cast(pa.string()), value_set=pa.array(sorted(sources)))
        )
    df = t.select(need).to_pandas()
    if columns is None or SEQ in columns:
        df[SEQ] = pd.Series(part.seq, index=df.index, dtype="int64")
    for c in columns or []:
        if c not in df.columns:
            df[c] = None
    return df[columns] if columns is not None else df


def scan_view(
    layout: Layout,
    ingest_id: str | None,
    table: str = "accepted",
    columns: list[str] | None = None,
    *,
    sources: set[str] | None = None,
    after_seq: int = 0,
) -> Iterator[pd.DataFrame]:
    """The view's rows, one row group at a time, oldest ingest first; only those of `sources`
    and of ingests after `after_seq` when given (a partition filter: no other file is
    opened). Every batch has the same columns."""
    parts = [
        p
        for p in view_parts(layout, ingest_id, table)
        if p.seq > after_seq and (sources is None or p.source is None or p.source in sources)
    ]
    if columns is None:
        columns = (
            accepted_columns(layout, ingest_id, parts)
            if table == "accepted"
            else view_columns(parts)
        )
    for p in parts:
        for g in range(p.row_groups):
            yield read_part(p, columns, [g], sources)


def read_view(layout: Layout, ingest_id: str | None) -> tuple[pd.DataFrame, pd.DataFrame, int]:
    """(accepted, quarantine, ingest_seq) of the view after `ingest_id`, whole in memory (for
    small catalogs and inspection; the pipeline's steps scan it); empty when None."""
    seq = chain(layout, ingest_id)[-1]["ingest_seq"] if ingest_id else 0
    frames = []
    for table, base in (("accepted", ACCEPTED_COLUMNS), ("quarantine", QUARANTINE_COLUMNS)):
        parts = view_parts(layout, ingest_id, table)
        if table == "accepted":
            cols = accepted_columns(layout, ingest_id, parts)
        else:
            cols = view_columns(parts) if parts else base
        got = [read_part(p, cols) for p in parts]
        frames.append(
            pd.concat([g for g in got if len(g)] or [pd.DataFrame(columns=cols)], ignore_index=True)
        )
    return frames[0], frames[1], int(seq)


def frame_rows(rows: list[dict], columns: list[str]) -> pd.DataFrame:
    """Rows as a frame with `columns` first (absent ones null), sorted by key."""
    df = pd.DataFrame(rows)
    for c in columns:
        if c not in df.columns:
            df[c] = None
    extra = [c for c in df.columns if c not in columns]
    df = df[columns + extra]
    return df.sort_values("key", kind="stable").reset_index(drop=True) if len(df) else df


def sql_str(value: str) -> str:
    """`value` as a SQL string literal."""
    return "'" + str(value).replace("'", "''") + "'"


def target_schema(schemas: list[pa.Schema], dt: DeltaTable | None) -> pa.Schema:
    """The columns of `schemas` (in order of first appearance), each of the table's type where
    it has the column, else the widest of their non-null types. Delta has no null type: a
    metadata column null everywhere and new to the table is left out, so that the ingest that
    first brings its values adds it with their type (readers see null in the rows before);
    one of the catalog's own columns is a string."""
    known = {f.name: f.type for f in pa.schema(dt.schema().to_arrow())} if dt else {}
    seen: dict[str, list[pa.DataType]] = {}
    for sch in schemas:
        for f in sch:
            seen.setdefault(f.name, []).append(f.type)
    fields = []
    for name, types in seen.items():
        found = [t for t in dict.fromkeys(types) if not pa.types.is_null(t)]
        if name not in known and not found and name not in _OWN_COLUMNS:
            continue
        want = known.get(name) or (_widest(name, found) if found else pa.string())
        fields.append(pa.field(name, want))
    return pa.schema(fields)


def _widest(name: str, types: list[pa.DataType]) -> pa.DataType:
    try:
        return pa.unify_schemas(
            [pa.schema([(name, t)]) for t in types], promote_options="permissive"
        )[0].type
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise InputError(f"catalog column {name!r} has values of types {types} ({e})") from e


def conform(t: pa.Table, schema: pa.Schema) -> pa.Table:
    """`t` with `schema`'s columns in its order and types (absent ones null)."""
    cols = []
    for f in schema:
        if f.name not in t.column_names:
            cols.append(pa.nulls(t.num_rows, f.type))
            continue
        col = t.column(f.name)
        try:
            cols.append(col if col.type == f.type else col.cast(f.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise InputError(
                f"catalog column {f.name!r}: {col.type} values do not fit the table's type "
                f"{f.type} ({e})"
            ) from e
    return pa.Table.from_arrays(cols, schema=schema)


def _arrow(df: pd.DataFrame, dt: DeltaTable | None, seq: int) -> pa.Table:
    """`df` as Arrow with `ingest_seq` (`seq` where absent), each column of the table's type."""
    t = untyped_nulls(
        pa.Table.from_pandas(
            df if SEQ in df.columns else df.assign(**{SEQ: seq}), preserve_index=False
        )
    )
    return conform(t, target_schema([t.schema], dt))


def untyped_nulls(t: pa.Table) -> pa.Table:
    """`t` with every column that holds only nulls (NaN included) of the null type, so that
    `target_schema` types it by the other values or the table, not by pandas' guess."""
    for i, col in enumerate(t.columns):
        if col.null_count == len(col) and not pa.types.is_null(col.type):
            t = t.set_column(i, t.field(i).name, pa.nulls(len(col)))
    return t


def write_ingest(
    layout: Layout, table: str, rows: pd.DataFrame, source: str, seq: int, replaced: str
) -> int | None:
    """Commit one ingest's `rows` (of `source`) to `table`; the source's rows matching the SQL
    condition `replaced` (over the table's columns) leave in the same commit. Returns the
    table's version after it (None: the table is still empty). An ingest run streams its rows
    instead (`tasks.catalog.staging.commit_staged`); this writes a frame held in memory."""
    dt = open_table(layout, table)
    cond = f"source = {sql_str(source)} AND ({replaced})"
    if dt is None and not len(rows):
        return None
    props = writer_properties()
    if not len(rows):
        dt.delete(cond, writer_properties=props)
    elif dt is None:
        write_deltalake(
            str(table_path(layout, table)),
            _arrow(rows, dt, seq),
            partition_by=[SEQ],
            writer_properties=props,
        )
    else:
        write_deltalake(
            dt,
            _arrow(rows, dt, seq),
            mode="overwrite",
            predicate=f"{SEQ} = {seq} OR ({cond})",
            schema_mode="merge",
            writer_properties=props,
        )
    return open_table(layout, table).version()


def writer_properties() -> WriterProperties:
    """How the catalog's data files are written: row groups of `ROW_GROUP` rows, Snappy (delta-rs
    writes uncompressed files by default, about 1.6 times the bytes)."""
    return WriterProperties(max_row_group_size=ROW_GROUP, compression="SNAPPY")


def write_catalog_dir(out: Path, tables: dict[str, pd.DataFrame | Path], summary: dict) -> None:
    """`<name>.parquet` per table (a frame, or a Parquet file copied) plus `summary.json`, in a
    folder renamed into place: a crash leaves no half catalog folder."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, df in tables.items():
        if isinstance(df, Path):
            shutil.copyfile(df, tmp / f"{name}.parquet")
        else:
            df.to_parquet(tmp / f"{name}.parquet", index=False, row_group_size=ROW_GROUP)
    (tmp / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
