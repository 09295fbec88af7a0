"""The catalog for a data team: show, query, export, compact, and migrate a chain-layout root.

Every read goes through the Delta tables (`tasks.catalog.view`) into Arrow; DuckDB queries that
Arrow data, never the tables through its own `delta` extension (it downloads the extension at
run time, which an air-gapped cluster cannot).

* `show`: the current table versions, accepted rows by source, quarantined rows by reason,
  and the commit history;
* `query`: DuckDB SQL over `clean` (the accepted rows less the verdict's rejects),
  `accepted` and `quarantine`, at the current view or at any table version;
* `export`: the clean view as Parquet or CSV;
* `compact`: bin-pack small files per partition (`optimize.compact`), then vacuum files
  that no version inside the retention horizon names, nor any version from the oldest one a
  registered model's dataset version was cut from;
* `migrate`: rewrite a root whose ingests wrote the chain layout (`tasks.catalog.legacy`)
  into the tables, one commit per ingest, so that every ingest id keeps its view.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError

from data_quality.content import store as content_store
from data_quality.verdict import read_verdict
from kiln_config import check_id
from kiln_config.errors import InputError
from tasks.catalog import legacy as catalog_legacy
from tasks.catalog.view import (
    TABLES,
    VERDICT_TABLES,
    chain,
    declared_columns,
    open_table,
    sql_str,
    surviving_version,
    table_path,
    view_versions,
    write_ingest,
    writer_properties,
)
from tasks.storage.layout import Layout
from tasks.storage.lock import catalog_writer

__all__ = [
    "DEFAULT_RETAIN_HOURS",
    "compact",
    "export",
    "migrate",
    "query",
    "registered_versions",
    "show",
]

DEFAULT_RETAIN_HOURS = 168  # vacuum keeps every version this recent (Delta's own default)


def _dataset(layout: Layout, table: str, version: int | None) -> ds.Dataset | None:
    dt = open_table(layout, table)
    if dt is None or version is None:
        return None
    return open_table(layout, table, surviving_version(dt, version)).to_pyarrow_dataset()


def _versions(layout: Layout, version: int | None) -> dict[str, int | None]:
    """The accepted table at `version` (and the quarantine as of the same time), or the
    view of the newest ingest."""
    if version is None:
        return view_versions(layout, layout.latest_or_none("catalog"))
    dt = open_table(layout, "accepted")
    if dt is None or not 0 <= version <= dt.version():
        newest = None if dt is None else dt.version()
        raise InputError(f"--version {version}: the accepted table's versions are 0..{newest}")
    return {"accepted": version, "quarantine": open_table(layout, "quarantine").version()}


def show(root: str) -> dict:
    """The catalog's state: table versions, rows by source and by quarantine reason (counted
    a batch at a time), the newest verdict's rejects by reason and a few of each with the value
    that failed, the content store's scores, and each table's commit history, newest first."""
    layout = Layout(Path(root))
    ingest_id = layout.latest_or_none("catalog")
    versions = view_versions(layout, ingest_id)
    counts = {}
    for table, col in (("accepted", "source"), ("quarantine", "reason")):
        data, c = _dataset(layout, table, versions[table]), Counter()
        for batch in data.to_batches(columns=[col]) if data is not None else []:
            c.update(batch.column(0).to_pylist())
        counts[table] = dict(sorted(c.items()))
    history = {}
    for table in TABLES:
        dt = open_table(layout, table)
        history[table] = [
            {k: h.get(k) for k in ("version", "timestamp", "operation", "operationMetrics")}
            for h in (dt.history() if dt else [])
        ]
    return {
        "ingest_id": ingest_id,
        "table_versions": versions,
        "accepted_by_source": counts["accepted"],
        "quarantined_by_reason": counts["quarantine"],
        # the newest verdict's rejects by reason: the quality rules, content rules included
        "rejected_by_reason": dict(
            sorted(Counter(_verdict_rejects(layout, ("reason",))["reason"].to_pylist()).items())
        ),
        "rejects": _rejects_sample(layout),
        "content": _content_summary(layout),
        "history": history,
    }


REJECTS_SHOWN = 5


def _rejects_sample(layout: Layout) -> dict:
    """The newest verdict's first `REJECTS_SHOWN` rejects of each reason, with the value that
    failed (a content rule's score or label): what a team would lose, before it is lost."""
    t = _verdict_rejects(layout, ("key", "reason", "detail")).to_pandas()
    return {
        reason: g.sort_values("key")[["key", "detail"]].head(REJECTS_SHOWN).to_dict("records")
        for reason, g in sorted(t.groupby("reason"), key=lambda kv: kv[0])
    }


def _content_summary(layout: Layout) -> dict:
    """Per content table and scorer: rows, and the score's quartiles where there is one
    (data_quality/content/store.py)."""
    out = {}
    for table in (content_store.IMAGES, content_store.CAPTIONS):
        path = content_store.table_dir(layout.folder("catalog"), table)
        if not (path / "_delta_log").is_dir():
            continue
        t = (
            DeltaTable(str(path))
            .to_pyarrow_dataset()
            .to_table(columns=["scorer", "score", "label"])
        )
        df = t.to_pandas()
        per = {}
        for scorer, g in df.groupby("scorer"):
            entry = {"rows": len(g)}
            if g["score"].notna().any():
                q = g["score"].quantile([0, 0.5, 0.99, 1]).round(4)
                entry["score"] = dict(zip(["min", "median", "p99", "max"], q.tolist(), strict=True))
            if g["label"].notna().any():
                entry["labels"] = g["label"].value_counts().head(10).to_dict()
            per[scorer] = entry
        out[table] = per
    return out


def _connect(root: str, version: int | None):
    """A DuckDB connection with `accepted`, `quarantine` and `clean` over Arrow datasets."""
    import duckdb

    layout = Layout(Path(root))
    versions = _versions(layout, version)
    con = duckdb.connect()
    datasets = {table: _dataset(layout, table, versions[table]) for table in TABLES}
    if all(data is None for data in datasets.values()):
        raise InputError(
            f"no catalog tables under {layout.folder('catalog')}: run `kiln ingest` first "
            "(or `kiln catalog migrate` for a root of the older layout)"
        )
    empty = pa.table({"source": pa.array([], pa.string()), "key": pa.array([], pa.string())})
    # A declared metadata column that no row has a value for yet is not in the table (see
    # `target_schema`): `accepted` has it, null, as Kiln's steps read it.
    accepted = datasets["accepted"]
    have = set((accepted if accepted is not None else empty).schema.names)
    absent = [
        c for c in declared_columns(layout, layout.latest_or_none("catalog")) if c not in have
    ]
    for table, data in datasets.items():
        name = "accepted_data" if table == "accepted" and absent else table
        con.register(name, data if data is not None else empty)
    if absent:
        nulls = "".join(f', NULL::VARCHAR AS "{c.replace(chr(34), chr(34) * 2)}"' for c in absent)
        con.execute(f"CREATE VIEW accepted AS SELECT *{nulls} FROM accepted_data")
    for table in (content_store.IMAGES, content_store.CAPTIONS):
        path = content_store.table_dir(layout.folder("catalog"), table)
        if (path / "_delta_log").is_dir():
            con.register(table, DeltaTable(str(path)).to_pyarrow_dataset())
    rejects = _verdict_rejects(layout)
    con.register("rejects", rejects)
    con.execute(
        "CREATE VIEW clean AS SELECT a.* FROM accepted a ANTI JOIN rejects r "
        "ON a.source = r.source AND a.key = r.key"
    )
    return con


def _verdict_rejects(layout: Layout, columns: tuple[str, ...] = ("source", "key")) -> pa.Table:
    """`columns` (of source, key, reason, detail) of the rows the newest ingest's verdict
    rejected, from the rejects table at the version the verdict wrote; none when it was not
    validated."""
    empty = pa.table({c: pa.array([], pa.string()) for c in columns})
    ingest_id = layout.latest_or_none("catalog")
    verdict = read_verdict(layout.catalog(ingest_id)) if ingest_id else None
    version = (verdict or {}).get("verdict_table_versions", {}).get("rejects")
    if version is None:
        return empty
    version = surviving_version(open_table(layout, "rejects"), version)  # compaction since
    data = open_table(layout, "rejects", version).to_pyarrow_dataset()
    got = data.to_table(columns=list(columns), filter=ds.field("verdict") == ingest_id)
    return got.cast(empty.schema) if got.num_rows else empty


def query(root: str, sql: str, version: int | None = None) -> pa.Table:
    """`sql` (DuckDB) over the tables `clean`, `accepted` and `quarantine` of the current view,
    or of the accepted table at `version`. A query DuckDB refuses raises `ValueError` with
    DuckDB's message."""
    import duckdb

    con = _connect(root, version)
    try:
        return con.execute(sql).to_arrow_table()
    except duckdb.Error as e:
        raise InputError(f"catalog sql: {e}") from e


def export(root: str, out: str, fmt: str = "parquet", version: int | None = None) -> int:
    """Write the clean view to `out` as `fmt` ("parquet" or "csv"); returns the row count."""
    if fmt not in ("parquet", "csv"):
        raise InputError(f"--format must be parquet or csv, got {fmt!r}")
    con = _connect(root, version)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    con.execute(f"COPY (SELECT * FROM clean) TO {sql_str(out)} (FORMAT {fmt})")
    return int(con.execute("SELECT count(*) FROM clean").fetchone()[0])


def registered_versions(root: str, tracking_uri: str, model_name: str) -> dict[str, int]:
    """The oldest version of each catalog table that a dataset version of a registered
    version of `model_name` was cut from (its `shards.json` `catalog_versions`)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri, registry_uri=tracking_uri)
    layout, out = Layout(Path(root)), {}
    for mv in client.search_model_versions(f"name={sql_str(model_name)}"):
        version = mv.tags.get("dataset_version")
        if not version:
            continue  # not a version Kiln registered
        tag = f"{mv.name} version {mv.version}'s dataset_version tag"
        meta = layout.shards(check_id(tag, version)) / "shards.json"
        if not meta.is_file():
            continue
        for table, v in json.loads(meta.read_text()).get("catalog_versions", {}).items():
            if v is not None:
                out[table] = min(int(v), out.get(table, int(v)))
    return out


def _horizon(dt, keep: int | None, retain_hours: float) -> int:
    """Hours of history vacuum keeps: `retain_hours`, or more, so that the files version
    `keep` reads stay (they were removed at the commit after it, or later)."""
    import time

    stamps = {h["version"]: h["timestamp"] for h in dt.history()}
    if keep is None or keep + 1 not in stamps:
        return int(retain_hours)
    age = (time.time() * 1000 - stamps[keep + 1]) / 3_600_000
    return max(int(retain_hours), int(age) + 1)


def compact(
    root: str, retain_hours: float = DEFAULT_RETAIN_HOURS, keep: dict[str, int] | None = None
) -> dict:
    """Compact each table's small files, then vacuum the files that no version of the last
    `retain_hours` names, nor any version at or after `keep[table]` (the versions a
    registered model's dataset was cut from: `registered_versions`). A view named by an
    older ingest stays readable while no rows changed since (`surviving_version`). Removes the
    staged rows an ingest killed before its commit left behind."""
    if retain_hours < 0:
        raise InputError(
            f"--retain-hours (ingest.compact_retain_hours) must be >= 0, got {retain_hours}"
        )
    layout, out = Layout(Path(root)), {}
    with catalog_writer(Path(root), "catalog compaction"):
        for table in (*TABLES, *VERDICT_TABLES):
            try:
                dt = open_table(layout, table)
                if dt is not None:
                    hours = _horizon(dt, (keep or {}).get(table), retain_hours)
                    out[table] = _compact_table(layout, table, dt, hours)
            except DeltaError as e:  # delta-rs appends a native backtrace: keep its first line
                raise RuntimeError(
                    f"compacting catalog table {table} at "
                    f"{table_path(layout, table)}: {str(e).splitlines()[0]}"
                ) from e
        # An ingest killed before its commit leaves its staged rows; none runs now (the lock).
        for stale in layout.folder("catalog").glob("*.staging"):
            shutil.rmtree(stale, ignore_errors=True)
    return out


def _compact_table(layout: Layout, table: str, dt, hours: int) -> dict:
    """Optimize then vacuum one table; what each did."""
    metrics = dt.optimize.compact(writer_properties=writer_properties())
    doomed = dt.vacuum(retention_hours=hours, enforce_retention_duration=False, dry_run=True)
    freed = sum(_size(table_path(layout, table) / unquote(p)) for p in doomed)
    gone = dt.vacuum(retention_hours=hours, enforce_retention_duration=False, dry_run=False)
    return {
        "files_added": metrics.get("numFilesAdded", 0),
        "files_removed": metrics.get("numFilesRemoved", 0),
        "bytes_added": _total_size(metrics.get("filesAdded")),
        "bytes_removed": _total_size(metrics.get("filesRemoved")),
        "vacuumed": len(gone),
        "vacuumed_bytes": freed,
        "retain_hours": hours,
        "version": open_table(layout, table).version(),
    }


def _total_size(stats: str | None) -> int:
    """`totalSize` of an optimize metric's file statistics (a JSON string)."""
    return int(json.loads(stats).get("totalSize", 0)) if stats else 0


def _size(path: Path) -> int:
    """Bytes of `path`; 0 when it is already gone (another vacuum got there first)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def migrate(root: str) -> list[str]:
    """Move a chain-layout catalog into the Delta tables, one commit per ingest of the newest
    chain, oldest first; each summary then names its table versions. Safe to re-run after a
    crash (the tables are rebuilt); returns the migrated ingest ids (none when done). Holds
    the catalog writer's lock while it commits."""
    layout = Layout(Path(root))
    latest = layout.latest_or_none("catalog")
    if latest is None or "table_versions" in chain(layout, latest)[-1]:
        return []
    with catalog_writer(Path(root), "kiln catalog migrate"):
        return _migrate(layout)


def _migrate(layout: Layout) -> list[str]:
    import shutil

    latest = layout.latest_or_none("catalog")  # again: another writer may have gone first
    if latest is None or "table_versions" in chain(layout, latest)[-1]:
        return []
    shutil.rmtree(layout.catalog_tables(), ignore_errors=True)
    links, versions = catalog_legacy.chain(layout, latest), {}
    for s in links:
        versions[s["id"]] = _migrate_one(layout, s)
    for s in links:
        folder = layout.catalog(s["id"])
        summary = json.loads((folder / "summary.json").read_text())
        tmp = folder / "summary.json.tmp"
        tmp.write_text(json.dumps({**summary, "table_versions": versions[s["id"]]}, indent=2))
        os.replace(tmp, folder / "summary.json")
    for s in links:
        for name in ("accepted", "quarantine", "view_accepted", "view_quarantine"):
            (layout.catalog(s["id"]) / f"{name}.parquet").unlink(missing_ok=True)
    return [s["id"] for s in links]


def _migrate_one(layout: Layout, s: dict) -> dict[str, int | None]:
    """Commit one chain-layout ingest's rows; its table versions after the commits."""
    folder, seq = layout.catalog(s["id"]), int(s["ingest_seq"])
    out = {}
    if s["legacy"]:  # a whole view of every source: the first commit of each table
        for table in TABLES:
            rows = pd.read_parquet(folder / f"view_{table}.parquet")
            out[table] = write_ingest(layout, table, rows, "", seq, "false")
        return out
    stale = pd.read_parquet(folder / "superseded.parquet")["unit"].astype(str).tolist()
    units = f"unit IN ({', '.join(map(sql_str, stale))})" if stale else "false"
    for table, replaced in (
        ("accepted", units),
        ("quarantine", f"{units} OR step = 'ingest-manifest'"),
    ):
        rows = pd.read_parquet(folder / f"{table}.parquet")
        got = write_ingest(layout, table, rows, s["source"], seq, replaced)
        dt = open_table(layout, table)
        out[table] = got if got is not None else (dt.version() if dt else None)
    return out
