"""The chain layout of a catalog, read only to migrate it (`kiln catalog migrate`,
`tasks.catalog.admin.migrate`) into the Delta tables of `tasks.catalog.view`.

In that layout the view is never written out whole. Each ingest writes only its own rows, and
the view after an ingest is a scan over the chain of ingests that led to it (each summary names its
`previous`), oldest first:

* `accepted.parquet` and `quarantine.parquet`: the rows this ingest decoded or rejected, in
  row groups of `ROW_GROUP` rows;
* `superseded.parquet`: the units (files, tar shards) of its source that this ingest replaced
  or found removed; a row of an earlier ingest of the same source whose unit is listed there
  has left the view;
* a source's manifest problems are those of its newest ingest.

A catalog folder written before the view was scanned holds the whole view after it
(`view_accepted.parquet`, `view_quarantine.parquet`); a chain ends there, and reads it as one
part of every source.

So an ingest of 20 new files writes 20 rows, whatever the size of the catalog, and reading
the view is a lazy scan in bounded memory (`scan_view`), in the order in which rows were
ingested: the earliest ingested copy of anything comes first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kiln_config import CATALOG_COLUMNS
from tasks.storage.layout import Layout

__all__ = [
    "ACCEPTED_COLUMNS",
    "QUARANTINE_COLUMNS",
    "ROW_GROUP",
    "ViewPart",
    "chain",
    "read_part",
    "read_view",
    "view_columns",
    "view_parts",
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


@dataclass(frozen=True)
class ViewPart:
    """One ingest's rows of one table, and which of them have left the view since."""

    path: Path
    ingest_id: str
    seq: int
    source: str | None  # None: a whole view written by an older Kiln, of every source
    rows: int  # rows in the file, before `dead` is applied
    row_groups: int
    # "<source>\0<unit>" of the units superseded by later ingests
    dead: tuple[str, ...] = field(default=(), repr=False)
    drop_manifest: tuple[str, ...] = ()  # sources whose manifest problems a later ingest replaced

    @property
    def whole(self) -> bool:
        """Every row of the file is in the view."""
        return not self.dead and not self.drop_manifest


def chain(layout: Layout, ingest_id: str | None) -> list[dict]:
    """The summaries of the ingests behind `ingest_id`'s view, oldest first (each with `id`)."""
    out = []
    while ingest_id is not None:
        folder = layout.catalog(ingest_id)
        summary = json.loads((folder / "summary.json").read_text())
        legacy = not (folder / "superseded.parquet").is_file()
        out.append({**summary, "id": ingest_id, "legacy": legacy})
        ingest_id = None if legacy else summary.get("previous")
    return out[::-1]


def view_parts(layout: Layout, ingest_id: str | None, table: str = "accepted") -> list[ViewPart]:
    """The files that make up `table` ("accepted" or "quarantine") of the view after
    `ingest_id`, oldest first."""
    parts, dead, newer = [], set(), set()
    for s in reversed(chain(layout, ingest_id)):
        src, folder = (None if s["legacy"] else s["source"]), layout.catalog(s["id"])
        path = folder / (f"view_{table}.parquet" if s["legacy"] else f"{table}.parquet")
        meta = pq.ParquetFile(path).metadata
        mine = dead if src is None else {d for d in dead if d.startswith(src + "\0")}
        parts.append(
            ViewPart(
                path=path,
                ingest_id=s["id"],
                seq=int(s["ingest_seq"]),
                source=src,
                rows=meta.num_rows,
                row_groups=meta.num_row_groups,
                dead=tuple(sorted(mine)),
                drop_manifest=tuple(sorted(newer if src is None else newer & {src})),
            )
        )
        if src is not None:
            gone = pq.read_table(folder / "superseded.parquet", columns=["unit"]).column("unit")
            dead.update(f"{src}\0{u}" for u in gone.to_pylist())
            newer.add(src)
    return parts[::-1]


def view_columns(parts: list[ViewPart]) -> list[str]:
    """The union of the parts' columns: the catalog's own first, then metadata columns in the
    order they first appear."""
    names: list[str] = []
    for p in parts:
        names += [n for n in pq.read_schema(p.path).names if n not in names]
    own = [c for c in (*ACCEPTED_COLUMNS, *QUARANTINE_COLUMNS) if c in names]
    return list(dict.fromkeys(own)) + [n for n in names if n not in own]


def read_part(
    part: ViewPart,
    columns: list[str] | None = None,
    row_groups: list[int] | None = None,
    sources: set[str] | None = None,
) -> pd.DataFrame:
    """The part's rows still in the view (of `row_groups` and `sources` only, when given), with
    `columns` (absent ones null)."""
    f = pq.ParquetFile(part.path)
    have = f.schema_arrow.names
    need = have if columns is None else [c for c in columns if c in have]
    extra = [c for c in ("source", "unit", "step") if c in have and c not in need]
    groups = list(range(f.num_row_groups) if row_groups is None else row_groups)
    t = f.read_row_groups(groups, columns=need + extra) if groups else f.schema_arrow.empty_table()
    if t.num_rows and part.dead:
        uid = pc.binary_join_element_wise(_str(t, "source"), _str(t, "unit"), "\0")
        t = t.filter(pc.invert(pc.is_in(uid, value_set=pa.array(part.dead))))
    if t.num_rows and part.drop_manifest and "step" in t.column_names:
        replaced = pc.is_in(_str(t, "source"), value_set=pa.array(part.drop_manifest))
        manifest = pc.equal(_str(t, "step"), "ingest-manifest")
        t = t.filter(pc.invert(pc.fill_null(pc.and_(replaced, manifest), False)))
    if t.num_rows and sources is not None and part.source is None:
        t = t.filter(pc.is_in(_str(t, "source"), value_set=pa.array(sorted(sources))))
    df = t.select(need).to_pandas()
    for c in columns or []:
        if c not in df.columns:
            df[c] = None
    return df[columns] if columns is not None else df


def _str(t: pa.Table, name: str) -> pa.ChunkedArray:
    return t.column(name).cast(pa.string())


def read_view(layout: Layout, ingest_id: str | None) -> tuple[pd.DataFrame, pd.DataFrame, int]:
    """(accepted, quarantine, ingest_seq) of the view after `ingest_id`, whole in memory (for
    small catalogs and inspection; the pipeline's steps scan it); empty when None."""
    seq = chain(layout, ingest_id)[-1]["ingest_seq"] if ingest_id else 0
    frames = []
    for table, base in (("accepted", ACCEPTED_COLUMNS), ("quarantine", QUARANTINE_COLUMNS)):
        parts = view_parts(layout, ingest_id, table)
        cols = view_columns(parts) if parts else base
        got = [read_part(p, cols) for p in parts]
        frames.append(
            pd.concat([g for g in got if len(g)] or [pd.DataFrame(columns=cols)], ignore_index=True)
        )
    return frames[0], frames[1], int(seq)
