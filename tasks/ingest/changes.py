"""What an ingest changes: a source's listing compared with the view, out of core.

Nothing here grows with the source in memory. The listing, the manifest's rows, this
source's rows in the view and the run's items are staged as Parquet files in a folder under
the root (`PlanFiles`), a batch at a time, and DuckDB joins and sorts them there, under a
memory limit and spilling to that folder when it needs more. The driver holds a batch of
rows at a time, however many items the source has.

`plan_run` lists the source (the top-level folders as Prefect tasks, the objects directly under
the root in batches), reads the manifest, stages this source's rows of the view, and finds:

* the items to decode: new, or changed since the view (key plus size and ETag or mtime, and
  the versions of its sidecars or manifest row), in key order;
* the files quarantined from the listing alone (unsafe keys, stray extensions) that are new
  or changed;
* the units gone from the source;
* the manifest's problems, and the listing delta (the listed objects of what the run decodes
  or rejects), staged before the decode for the commit.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.catalog.view import scan_view
from tasks.ingest.sources import (
    MANIFEST_NAMES,
    Manifest,
    is_unsafe_key,
    iter_manifest,
    plan_object,
    split_ext,
)
from tasks.runtime.logs import task_logger
from tasks.runtime.runners import release_freed_memory
from tasks.storage.layout import Layout
from tasks.storage.objects import ObjectInfo, Storage

if TYPE_CHECKING:
    from kiln_config import IngestConfig

__all__ = ["BATCH", "Plan", "PlanFiles", "in_order", "list_partition", "plan_run"]

BATCH = 10_000  # rows the driver handles at a time
_MEMORY = "128MB"  # DuckDB's limit; past it, it spills to the plan's folder

_LISTING = pa.schema([("key", pa.string()), ("size", pa.int64()), ("version", pa.string())])
_OBJECTS = pa.schema(
    [
        *_LISTING,
        ("stem", pa.string()),
        ("ext", pa.string()),
        ("unsafe", pa.bool_()),
        ("is_tar", pa.bool_()),
    ]
)
_MANIFEST = pa.schema(
    [
        ("line", pa.int64()),
        ("key", pa.string()),
        ("file_name", pa.string()),
        ("caption", pa.string()),
        ("meta", pa.binary()),
        ("reason", pa.string()),
        ("detail", pa.string()),
    ]
)
_ITEMS = pa.schema(
    [
        ("key", pa.string()),
        ("kind", pa.string()),
        ("version", pa.string()),
        ("caption", pa.string()),
        ("meta", pa.binary()),
        ("txt", pa.string()),
        ("json", pa.string()),
        ("reason", pa.string()),
        ("detail", pa.string()),
    ]
)
_KNOWN_ACC = pa.schema([("unit", pa.string()), ("unit_version", pa.string())])
_KNOWN_Q = pa.schema([*_KNOWN_ACC, ("step", pa.string()), ("reason", pa.string())])


def listing_table(objs: Iterable[ObjectInfo]) -> pa.Table:
    """Listed objects as a compact table (key, size, version)."""
    objs = list(objs)
    cols = [
        pa.array([o.key for o in objs], pa.string()),
        pa.array([o.size for o in objs], pa.int64()),
        pa.array([o.version for o in objs], pa.string()),
    ]
    return pa.table(cols, schema=_LISTING)


@task(name="list-partition", retries=3, retry_delay_seconds=2, cache_policy=NO_CACHE)
def list_partition(source: str, prefix: str, endpoint_url: str | None = None) -> pa.Table:
    """Every object below one top-level folder of the source (S3 listing paginates), as a
    table of key, size and version (about 60 bytes an object)."""
    parts = [listing_table(b) for b in Storage(source, endpoint_url).iter_list(prefix)]
    return pa.concat_tables(parts) if parts else _LISTING.empty_table()


def in_order(submit: Callable[[object], object], args: Iterable, window: int) -> Iterator:
    """(a, the result of the future `submit(a)`) for each of `args`, in order, with at most
    `window` submitted and not yet taken: a result is held until it is taken, so the driver
    holds a few of them, not all."""
    pending: deque = deque()
    for a in args:
        pending.append((a, submit(a)))
        if len(pending) >= window:
            a, f = pending.popleft()
            yield a, f.result()
    while pending:
        a, f = pending.popleft()
        yield a, f.result()


class PlanFiles:
    """The staged tables of one run's plan under `folder`, and DuckDB over them."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        self.con = self._connect()

    def _connect(self) -> duckdb.DuckDBPyConnection:
        return duckdb.connect(
            config={
                "memory_limit": _MEMORY,
                "temp_directory": str(self.folder / "spill"),
                "threads": 2,
                "autoinstall_known_extensions": False,
                "autoload_known_extensions": False,
            }
        )

    def release(self) -> None:
        """Hand DuckDB's memory back: a new connection (the staged tables are files, so
        nothing is lost), and the freed memory to the OS."""
        self.con.close()
        self.con = self._connect()
        release_freed_memory()

    def path(self, name: str) -> str:
        return str(self.folder / f"{name}.parquet")

    def _literal(self, name: str) -> str:
        return "'" + self.path(name).replace("'", "''") + "'"

    def write(self, name: str, schema: pa.Schema, batches: Iterable[pa.Table | list[dict]]) -> int:
        """Stage `name`: the rows of `batches` (tables or lists of row dicts); its row count."""
        n = 0
        with pq.ParquetWriter(self.path(name), schema) as w:
            for b in batches:
                t = b if isinstance(b, pa.Table) else pa.Table.from_pylist(b, schema=schema)
                if t.num_rows:
                    w.write_table(t.select(schema.names).cast(schema))
                    n += t.num_rows
        return n

    def _query(self, query: str) -> str:
        names = {
            p.stem: f"read_parquet({self._literal(p.stem)})" for p in self.folder.glob("*.parquet")
        }
        return query.format(**names)

    def sql(self, query: str, params: list | None = None) -> duckdb.DuckDBPyConnection:
        """Run `query`, where `{name}` reads a staged table."""
        return self.con.execute(self._query(query), params or [])

    def copy(self, query: str, name: str, params: list | None = None) -> int:
        """Stage the result of `query` as `name`; its row count."""
        to = f"{self._literal(name)} (FORMAT parquet, ROW_GROUP_SIZE {BATCH})"
        self.con.execute(f"COPY ({self._query(query)}) TO {to}", params or [])
        return self.count(name)

    def count(self, name: str) -> int:
        return int(self.sql(f"SELECT count(*) FROM {{{name}}}").fetchone()[0])

    def table(self, query: str, params: list | None = None) -> pa.Table:
        """The rows of `query`, whole, as a table."""
        return self.con.cursor().sql(self._query(query), params=params or None).to_arrow_table()

    def batches(
        self, query: str, params: list | None = None, size: int | None = None
    ) -> Iterator[list[dict]]:
        """The rows of `query`, streamed, a batch of dicts at a time (`BATCH` rows unless
        `size` is given), on a cursor of its own, so that other queries can run while it is
        read."""
        rel = self.con.cursor().sql(self._query(query), params=params or None)
        for b in rel.to_arrow_reader(size or BATCH):
            yield b.to_pylist()

    def close(self) -> None:
        self.con.close()
        shutil.rmtree(self.folder, ignore_errors=True)


@dataclass
class Plan:
    """One run's work: what the source holds now, against the view of the previous ingest.
    Its rows are staged in `files`: `objects` (the listing), `manifest`, `items` (every item
    and listing reject of the source now), `known_acc` and `known_q` (this source's rows in
    the view), `todo` (the items to decode), `rejects` (new or changed listing rejects),
    `removed` (units gone from the source), `stale` (the units whose rows this run replaces
    or removes), and, when it changes the view, `problems` and `listing_delta`
    (`stage_changes`)."""

    src: str
    source_format: str
    manifest: Manifest
    settings: dict  # the ingest settings this source's rows were built with
    previous: str | None  # the ingest whose view this run starts from
    prev_summary: dict
    seq: int
    files: PlanFiles
    listed: int  # items and listing rejects of the source now
    todo: int  # new or changed items: decoded this run
    rejects: int  # new or changed listing rejects
    removed: int  # units gone from the source
    ingest_id: str | None  # None: nothing changed, the previous ingest stays current

    @property
    def manifest_changed(self) -> bool:
        return self.prev_summary.get("manifests", {}).get(self.src) != self.manifest.version

    def todo_batches(self, size: int) -> Iterator[list[dict]]:
        return self.files.batches("SELECT * FROM {todo}", size=size)  # staged in key order

    def reject_batches(self) -> Iterator[list[dict]]:
        return self.files.batches("SELECT * FROM {rejects}")

    def problem_batches(self) -> Iterator[list[dict]]:
        """The manifest's problems: unusable rows, second rows of a file name, file names
        the source does not have (staged by `stage_changes`)."""
        return self.files.batches("SELECT * FROM {problems}")

    @property
    def listing_delta(self) -> Path:
        """The staged listing delta (see `stage_changes`)."""
        return Path(self.files.path("listing_delta"))

    def stage_changes(self) -> None:
        """Stage, before anything is decoded, what the run's commit writes besides its rows:
        the manifest's problems, and the listed objects of the units this run decodes or
        rejects (with their sidecars) and the manifest when it changed (`listing_delta`).
        Their queries join the whole listing; run here, their working memory is spent
        while the driver holds little else."""
        self.files.copy(_PROBLEMS, "problems")
        manifest = self.manifest.name if self.manifest.name and self.manifest_changed else ""
        self.files.copy(
            "SELECT o.key, o.size, o.version, ?::VARCHAR AS source FROM {objects} o SEMI JOIN ("
            "SELECT key FROM {todo} UNION SELECT txt FROM {todo} WHERE txt IS NOT NULL UNION "
            "SELECT json FROM {todo} WHERE json IS NOT NULL UNION SELECT key FROM {rejects} "
            "UNION SELECT ?::VARCHAR) d ON d.key = o.key ORDER BY o.key",
            "listing_delta",
            [self.src, manifest],
        )

    def stale_between(self, lo: str | None, hi: str | None) -> pa.Array:
        """The units whose rows this run replaces or removes, from `lo` to `hi` (None: no
        bound), sorted."""
        q = (
            "SELECT unit FROM {stale} WHERE (?::VARCHAR IS NULL OR unit >= ?) "
            "AND (?::VARCHAR IS NULL OR unit <= ?) ORDER BY unit"
        )
        got = self.files.table(q, [lo, lo, hi, hi])
        return got.column("unit").combine_chunks() if got.num_rows else pa.array([], pa.string())

    def removed_units(self, limit: int) -> list[str]:
        q = "SELECT unit FROM {removed} LIMIT ?"
        return [r[0] for r in self.files.sql(q, [limit]).fetchall()]

    def view_counts(self) -> dict:
        """This source's rows in the view: `accepted` and `quarantined` before the run, those
        this run keeps (`kept_accepted`, and `kept_files` by (step, reason), the files'
        quarantine rows), and `quarantine` by (step, reason) before it."""
        f = self.files
        acc, kept = f.sql(
            "SELECT count(*), count(*) FILTER (WHERE s.unit IS NULL) FROM "
            "{known_acc} k LEFT JOIN {stale} s USING (unit)"
        ).fetchone()
        rows = f.sql(
            "SELECT step, reason, count(*), count(*) FILTER (WHERE s.unit IS NULL) "
            "FROM {known_q} k LEFT JOIN {stale} s USING (unit) "
            "GROUP BY step, reason"
        ).fetchall()
        return {
            "accepted": int(acc),
            "kept_accepted": int(kept),
            "quarantined": sum(int(r[2]) for r in rows),
            "quarantine": Counter({(r[0], r[1]): int(r[2]) for r in rows}),
            "kept_files": Counter(
                {(r[0], r[1]): int(r[3]) for r in rows if r[0] == "ingest" and r[3]}
            ),
        }


# The manifest's rows a file name keeps (its first), and its problems.
_FIRST_ROWS = """SELECT * FROM {manifest} WHERE reason IS NULL
    QUALIFY row_number() OVER (PARTITION BY file_name ORDER BY line) = 1"""
_PROBLEMS = """
SELECT key, reason, detail FROM (
    SELECT line, key, reason, detail FROM {manifest} WHERE reason IS NOT NULL
    UNION ALL
    SELECT line, key, 'manifest_duplicate_row', left('second row for ' || file_name, 500)
    FROM {manifest} WHERE reason IS NULL
    QUALIFY row_number() OVER (PARTITION BY file_name ORDER BY line) > 1
    UNION ALL
    SELECT 9223372036854775807, file_name, 'manifest_missing_file',
           'listed in the manifest, not in the source'
    FROM {manifest} m WHERE reason IS NULL
        AND NOT EXISTS (SELECT 1 FROM {objects} o WHERE o.key = m.file_name)
    GROUP BY file_name
) ORDER BY line, key"""


def plan_run(
    store: Storage,
    cfg: IngestConfig,
    cat_layout: Layout,
    runner,
    endpoint_url: str | None,
    folder: Path,
) -> Plan:
    """List the source and compare it with the view, item by item: what to decode, what is
    gone. The plan's rows are staged under `folder`."""
    files = PlanFiles(folder)
    try:
        return _plan(store, cfg, cat_layout, runner, endpoint_url, files)
    except BaseException:
        files.close()
        raise


def _plan(
    store: Storage,
    cfg: IngestConfig,
    cat_layout: Layout,
    runner,
    endpoint_url: str | None,
    files: PlanFiles,
) -> Plan:
    src = store.url()
    log = task_logger(__name__)
    tables = _counted(_listing(store, runner, endpoint_url, cfg), f"listing {src}", "objects")
    listed = files.write("objects", _OBJECTS, (_objects(t) for t in tables))
    log.info("listed %d objects in %s", listed, src)
    exts = sorted({e.lower() for e in cfg.image_extensions})
    chosen = cfg.layout if cfg.layout != "auto" else _detect_format(files, exts)
    manifest = _stage_manifest(store, files, chosen, cfg)
    previous = cat_layout.latest_or_none("catalog")
    prev_summary = (
        json.loads((cat_layout.catalog(previous) / "summary.json").read_text()) if previous else {}
    )
    _stage_known(files, cat_layout, previous, src)
    settings = {
        "layout": chosen,
        "caption_column": cfg.caption_column,
        "metadata_columns": list(cfg.metadata_columns),
        "max_pixels": cfg.max_pixels,
        # They decide which tar members are images.
        "image_extensions": exts,
    }
    rebuild = prev_summary.get("source_settings", {}).get(src, settings) != settings
    if rebuild:
        # New caption or metadata columns, another pixel limit or other extensions: every row
        # of this source must be rebuilt, not only the changed files.
        log.info("ingest settings for %s changed: re-reading every item", src)
    n_items = files.write("items", _ITEMS, _items(files, chosen, set(exts), manifest))
    counts = _compare(files, rebuild)
    plan = Plan(
        src=src,
        source_format=chosen,
        manifest=manifest,
        settings=settings,
        previous=previous,
        prev_summary=prev_summary,
        seq=int(prev_summary.get("ingest_seq", 0)),
        files=files,
        listed=n_items,
        ingest_id=None,
        **counts,
    )
    if plan.todo or plan.rejects or plan.removed or plan.manifest_changed or previous is None:
        state = {**settings, "previous": previous, "manifest": manifest.version}
        plan.ingest_id = _ingest_id(files, src, state)
        plan.stage_changes()
    return plan


def _listing(
    store: Storage, runner, endpoint_url: str | None, cfg: IngestConfig
) -> Iterator[pa.Table]:
    """The source's listing, a table at a time: the objects directly under the root in
    batches, then one task per top-level folder."""
    dirs: list[str] = []
    for d, objs in store.iter_top_level(BATCH):
        dirs += d
        yield listing_table(objs)
    args = (
        {"source": store.url(), "prefix": d, "endpoint_url": endpoint_url} for d in sorted(dirs)
    )
    window = 2 * max(1, cfg.workers or 2)
    for _, t in in_order(lambda a: runner.submit(list_partition, a), args, window):
        yield t


def _counted(
    tables: Iterable[pa.Table], what: str, unit: str, interval_s: float = 10.0
) -> Iterator[pa.Table]:
    """`tables`, with a log line about every `interval_s` seconds of the rows so far (a
    listing has no total to show progress against)."""
    log, n, last = task_logger(__name__), 0, time.monotonic()
    for t in tables:
        n += t.num_rows
        if time.monotonic() - last >= interval_s:
            log.info("%s: %d %s so far", what, n, unit)
            last = time.monotonic()
        yield t


def _objects(t: pa.Table) -> pa.Table:
    """The listing with what planning asks of each key: its stem and lower-case extension,
    whether it escapes the source, whether it names a tar."""
    keys = t.column("key").to_pylist()
    split = [split_ext(k) for k in keys]
    return (
        t.append_column("stem", pa.array([s for s, _ in split], pa.string()))
        .append_column("ext", pa.array([e for _, e in split], pa.string()))
        .append_column("unsafe", pa.array([is_unsafe_key(k) for k in keys], pa.bool_()))
        .append_column("is_tar", pa.array([k.lower().endswith(".tar") for k in keys], pa.bool_()))
    )


def _detect_format(files: PlanFiles, exts: list[str]) -> str:
    """Guess the source's format: tars mean webdataset, a top-level manifest imagefolder, `.txt`
    sidecars img2dataset; anything else is treated as an imagefolder without a manifest."""
    if files.sql("SELECT 1 FROM {objects} WHERE is_tar LIMIT 1").fetchone():
        return "webdataset"
    names = list(MANIFEST_NAMES)
    if files.sql("SELECT 1 FROM {objects} WHERE list_contains(?, key) LIMIT 1", [names]).fetchone():
        return "imagefolder"
    if files.sql(
        "SELECT 1 FROM {objects} i JOIN {objects} t ON t.key = i.stem || '.txt' "
        "WHERE list_contains(?, i.ext) LIMIT 1",
        [exts],
    ).fetchone():
        return "img2dataset"
    return "imagefolder"


def _stage_manifest(store: Storage, files: PlanFiles, chosen: str, cfg: IngestConfig) -> Manifest:
    """Stage the manifest's rows (an imagefolder's; none for the other formats)."""
    found = None
    if chosen == "imagefolder":
        names = [cfg.metadata_file] if cfg.metadata_file else list(MANIFEST_NAMES)
        found = files.sql(
            "SELECT key, version FROM {objects} WHERE list_contains(?, key) ORDER BY key LIMIT 1",
            [names],
        ).fetchone()
        if found is None:
            task_logger(__name__).warning(
                "no manifest (%s) in %s: images will lack captions", names, store.url()
            )
    if found is None:
        files.write("manifest", _MANIFEST, [])
        return Manifest()
    name, version = found
    if store.is_s3:
        local = files.folder / "source" / Path(name).name  # not a staged table's name
        local.parent.mkdir()
        store.download(name, local)
    else:
        local = Path(store.url(name))
    rows = iter_manifest(local, name, cfg.caption_column, list(cfg.metadata_columns))
    files.write("manifest", _MANIFEST, _chunked(rows, BATCH))
    return Manifest(name, version)


def _chunked(rows: Iterable[dict], size: int) -> Iterator[list[dict]]:
    batch: list[dict] = []
    for r in rows:
        batch.append(r)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def _stage_known(files: PlanFiles, cat_layout: Layout, previous: str | None, src: str) -> None:
    """Stage `src`'s (accepted, quarantined) rows in the view after `previous`: a scan of the
    source's own ingests, four narrow columns, never the other sources' rows."""
    for name, table, schema in (
        ("known_acc", "accepted", _KNOWN_ACC),
        ("known_q", "quarantine", _KNOWN_Q),
    ):
        frames = scan_view(cat_layout, previous, table, schema.names, sources={src})
        files.write(name, schema, (pa.Table.from_pandas(f, preserve_index=False) for f in frames))


def _items(
    files: PlanFiles, chosen: str, exts: set[str], manifest: Manifest
) -> Iterator[list[dict]]:
    """Every item and listing reject of the source, a batch at a time (in no order): each
    listed object less the manifest and the sidecars images consume, with its sidecars
    (img2dataset) or its manifest row (imagefolder) beside it."""
    images = "SELECT stem FROM {objects} WHERE list_contains(?, ext) AND NOT unsafe"
    sidecars = (
        f"SELECT stem || '.txt' AS key FROM ({images}) UNION SELECT stem || '.json' FROM ({images})"
    )
    params: list = [manifest.name or ""]
    if chosen == "img2dataset":
        query = f"""
        SELECT o.*, t.key AS txt, t.version AS txt_version, j.key AS json,
               j.version AS json_version
        FROM {{objects}} o
        LEFT JOIN {{objects}} t ON t.key = o.stem || '.txt'
        LEFT JOIN {{objects}} j ON j.key = o.stem || '.json'
        WHERE o.key <> ? AND o.key NOT IN ({sidecars})
        """
        params += [sorted(exts), sorted(exts)]
    else:
        query = f"""
        SELECT o.*, m.caption, m.meta, m.file_name IS NOT NULL AS has_row
        FROM {{objects}} o LEFT JOIN ({_FIRST_ROWS}) m ON m.file_name = o.key
        WHERE o.key <> ?"""
    for batch in files.batches(query, params):
        yield [plan_object(r, chosen, exts) for r in batch]


def _compare(files: PlanFiles, rebuild: bool) -> dict[str, int]:
    """Stage what changed against this source's rows in the view, each in key order:
    `todo`, `rejects`, `removed` and `stale`; their counts."""
    known = (
        "SELECT unit, max_by(unit_version, pri) AS v FROM ("
        "SELECT unit, unit_version, 0 AS pri FROM {known_acc} UNION ALL "
        "SELECT unit, unit_version, 1 FROM {known_q} WHERE step = 'ingest') GROUP BY unit"
    )
    if rebuild:  # nothing is known: every item is read again
        known = "SELECT NULL::VARCHAR AS unit, NULL::VARCHAR AS v WHERE false"
    changed = (
        f"SELECT i.* FROM {{items}} i LEFT JOIN ({known}) k ON k.unit = i.key "
        "WHERE k.v IS DISTINCT FROM i.version"
    )
    todo = files.copy(f"SELECT * FROM ({changed}) WHERE kind <> 'reject' ORDER BY key", "todo")
    rejects = files.copy(f"SELECT * FROM ({changed}) WHERE kind = 'reject' ORDER BY key", "rejects")
    units = "SELECT unit FROM {known_acc} UNION SELECT unit FROM {known_q} WHERE step = 'ingest'"
    removed = files.copy(
        f"SELECT unit FROM ({units}) u WHERE NOT EXISTS "
        "(SELECT 1 FROM {items} i WHERE i.key = u.unit) ORDER BY unit",
        "removed",
    )
    files.copy(
        "SELECT key AS unit FROM {todo} UNION SELECT key FROM {rejects} "
        "UNION SELECT unit FROM {removed} ORDER BY unit",
        "stale",
    )
    return {"todo": todo, "rejects": rejects, "removed": removed}


def _ingest_id(files: PlanFiles, source: str, state: dict) -> str:
    """An id for this change of the view: a hash of the source, `state` (the previous ingest
    id, the manifest version and the settings), the changed items and the removed units, so
    that an id is never reused for other content."""
    h = hashlib.sha256(json.dumps([source, state], sort_keys=True).encode())
    for query in (
        "SELECT key, version FROM {todo}",
        "SELECT key, version FROM {rejects}",
        "SELECT unit, '' FROM {removed}",
    ):  # each staged in key order
        for batch in files.batches(query):
            for row in batch:
                h.update(json.dumps(list(row.values())).encode())
    return "ing-" + h.hexdigest()[:12]
