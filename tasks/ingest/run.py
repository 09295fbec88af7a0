"""Ingest: list a source in partitions, decode what is new, and keep an accumulating catalog.

A run commits only the rows it decoded or rejected to the catalog's Delta tables
(`tasks.catalog.view`: `<root>/catalog/tables/accepted` and `.../quarantine`, one commit per
table, in which the rows of the units it replaced or found removed leave), and
`<root>/catalog/<ingest_id>/` gets:

* `listing.parquet`: the objects of the run's listing that were new or changed (key, size,
  ETag or mtime);
* `superseded.parquet`: the units of the source this run replaced or found removed;
* `summary.json`: counts, per-reason tallies, the incremental delta and the table versions
  its commits produced (`table_versions`: the view after this ingest, read by time travel).

The current view, every row of every source ingested into this root that is still present
(what validate reads), is the tables at those versions. `<root>/catalog/LATEST` names the
ingest whose view is current. A run compares the listing with its source's rows in the view,
item by item (key plus size and ETag or mtime, and the versions of its sidecars or manifest
row): unchanged items are not read again, changed ones replace their old rows, and items gone
from the source leave the view. A re-run over an unchanged source decodes nothing and adds no
rows.

Listing and decoding run as Prefect tasks over partitions: the top-level folders of the
source, and then chunks of `partition_size` items. Locally the decode tasks share a process
pool; with `dask_address` they run on a Dask cluster through prefect-dask's DaskTaskRunner.

`ingest_source` runs the phases in order: list the source and compare it with the view, out
of core (`tasks.ingest.changes.plan_run`), decode the new and changed items a few partitions at
a time (`_decode`), staging each partition's rows on disk as it finishes (`_RunRows`), so
that the driver's memory does not grow with the number of items, count the
view after them (`_summarize`), commit the staged rows (`_commit_rows`, streamed into the
tables) and write the catalog folder (`write_catalog_dir`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from prefect import task
from prefect.cache_policies import NO_CACHE

from kiln_config.errors import InputError, MissingInput
from tasks.catalog.staging import Replaced, StagedRows, commit_staged
from tasks.catalog.view import (
    ACCEPTED_COLUMNS,
    QUARANTINE_COLUMNS,
    read_view,
    write_catalog_dir,
)
from tasks.ingest.changes import Plan, in_order, list_partition, plan_run
from tasks.ingest.inspect import InspectOptions, inspect_item
from tasks.ingest.sources import SOURCE_FORMATS, Item, item_from_row
from tasks.runtime.logs import task_logger
from tasks.runtime.progress import Progress
from tasks.runtime.runners import partition_runner, release_freed_memory
from tasks.storage.layout import Layout
from tasks.storage.lock import catalog_writer
from tasks.storage.objects import Storage

if TYPE_CHECKING:  # the schema's home; annotations only, nothing imported at run time
    from kiln_config import IngestConfig

__all__ = [
    "ACCEPTED_COLUMNS",
    "QUARANTINE_COLUMNS",
    "IngestResult",
    "decode_partition",
    "ingest_source",
    "list_partition",
    "read_view",
]


@dataclass
class IngestResult:
    ingest_id: str
    source: str
    layout: str  # the source's format, named as its setting (`ingest.layout`)
    listed: int  # items of this source now: accepted + quarantined (files or tar samples)
    accepted: int  # of `listed`
    quarantined: int  # of `listed`
    reasons: dict[str, int] = field(default_factory=dict)  # over `listed`
    manifest_problems: int = 0
    new_items: int = 0  # decoded this run (new or changed)
    unchanged_items: int = 0
    removed_items: int = 0
    decoded_accepted: int = 0
    decoded_quarantined: int = 0
    view_accepted: int = 0  # all sources in this root
    view_quarantined: int = 0
    reused: bool = False
    finished_at: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@task(name="decode-partition", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def decode_partition(
    opts: InspectOptions, items: list[Item], pool: Executor | None = None
) -> list[dict]:
    """Inspect a chunk of items: in `pool` when given (local runs), else in this process (on a
    Dask worker). Pure reads, so a retry is safe."""
    jobs = [(opts, it) for it in items]
    if pool is None:
        results = map(inspect_item, jobs)
    else:
        results = pool.map(inspect_item, jobs, chunksize=max(1, len(jobs) // 16))
    return [r for recs in results for r in recs]


def ingest_source(
    cfg: IngestConfig,
    root: str,
    *,
    endpoint_url: str | None = None,
    dask_address: str | None = None,
) -> IngestResult:
    """Catalog what is new or changed under `cfg.source` and update the current view.

    Must run where Prefect tasks can run (inside a flow, or standalone). Returns the run's
    counts; `reused` is true when nothing changed, and then no ingest id is created.

    Args:
        cfg: The `ingest` config section (source, layout, manifest, extensions, limits).
        root: The storage root; the catalog goes to `<root>/catalog/<ingest_id>/`.
        endpoint_url: S3-compatible endpoint for an s3:// source.
        dask_address: Run the listing and decode tasks on this Dask scheduler.
    """
    store = _open_source(cfg, endpoint_url)
    with catalog_writer(Path(root), f"kiln ingest of {store.url()}"):
        return _ingest(cfg, store, root, endpoint_url, dask_address)


def _ingest(
    cfg: IngestConfig,
    store: Storage,
    root: str,
    endpoint_url: str | None,
    dask_address: str | None,
) -> IngestResult:
    log = task_logger(__name__)
    cat_layout = Layout(Path(root))
    n_workers = cfg.workers or os.cpu_count() or 1
    with ExitStack() as stack:
        runner = stack.enter_context(partition_runner(n_workers, dask_address))
        # The writer lock is held: a plan folder left by a killed run is nobody's.
        plan = plan_run(
            store,
            cfg,
            cat_layout,
            runner,
            endpoint_url,
            cat_layout.folder("catalog") / "plan.staging",
        )
        stack.callback(plan.files.close)
        plan.files.release()  # the plan's batches and DuckDB's buffers
        if plan.ingest_id is None:
            log.info("source %s unchanged since %s: nothing to decode", plan.src, plan.previous)
            counts = plan.view_counts()
            return _result_for(
                plan.previous,
                plan.src,
                plan.source_format,
                counts["accepted"],
                counts["quarantine"],
                plan.prev_summary,
                reused=True,
            )
        log.info(
            "ingest %s (%s source): %d items listed, %d new or changed, %d removed; decoding "
            "in partitions of %d on %s",
            plan.ingest_id,
            plan.source_format,
            plan.listed,
            plan.todo + plan.rejects,
            plan.removed,
            cfg.partition_size,
            "Dask " + dask_address if dask_address else f"{n_workers} processes",
        )
        opts = InspectOptions(
            plan.src,
            endpoint_url,
            cfg.max_pixels,
            tuple(cfg.metadata_columns),
            tuple(cfg.image_extensions),
            cfg.max_bytes,
        )
        pool = None
        if not dask_address and plan.todo:
            # spawn, not fork: the parent runs Prefect's threads, and forking those can deadlock.
            pool = stack.enter_context(
                ProcessPoolExecutor(min(n_workers, plan.todo), mp_context=mp.get_context("spawn"))
            )
        rows = _RunRows(plan, cat_layout, list(cfg.metadata_columns))
        stack.callback(rows.discard)
        _decode(
            plan,
            opts,
            runner,
            pool,
            cfg.partition_size,
            rows.add_records,
            window=2 * max(2, n_workers),
        )
        rows.add_listing_problems()
        result, summary = _summarize(plan, rows)
        summary["table_versions"] = _commit_rows(cat_layout, plan, rows)
        write_catalog_dir(
            cat_layout.catalog(plan.ingest_id),
            {"listing": plan.listing_delta, "superseded": Path(plan.files.path("stale"))},
            summary,
        )
    cat_layout.set_latest("catalog", plan.ingest_id)
    return result


# -- phase 1: the source and its listing, compared with the view: tasks.ingest.changes ----------


def _open_source(cfg: IngestConfig, endpoint_url: str | None) -> Storage:
    if not cfg.source:
        raise InputError("ingest.source is not set: give a local folder or s3://bucket/prefix")
    if cfg.layout not in ("auto", *SOURCE_FORMATS):
        raise InputError(
            f"ingest.layout must be auto or one of {SOURCE_FORMATS}, got {cfg.layout!r}"
        )
    store = Storage(cfg.source, endpoint_url)
    if not store.is_s3 and not store.path.is_dir():
        raise MissingInput(f"ingest source {cfg.source!r} does not exist")
    return store


# -- phase 2: decode the new and changed items in partitions ----------------------------------


def _decode(
    plan: Plan,
    opts: InspectOptions,
    runner,
    pool: Executor | None,
    partition_size: int,
    sink: Callable[[list[dict]], None],
    window: int,
) -> None:
    """One decode task per partition of `partition_size` items, read from the plan's staged
    items and submitted `window` at a time; each partition's records go to `sink` as it
    finishes, in order, and are then let go (the driver holds a few partitions' items and
    records at a time, not the run's)."""
    progress = Progress("ingest", plan.todo, "items")
    parts = ([item_from_row(r) for r in batch] for batch in plan.todo_batches(partition_size))

    def submit(items: list[Item]):
        return runner.submit(decode_partition, {"opts": opts, "items": items, "pool": pool})

    for i, (items, records) in enumerate(in_order(submit, parts, window), start=1):
        sink(records)
        progress.advance(len(items))
        if i % 16 == 0:  # what the finished partitions freed goes back to the OS
            release_freed_memory()
    progress.finish()


# -- phase 3: the run's rows, merged into the view ---------------------------------------------


class _RunRows:
    """This run's (accepted, quarantine) rows, staged under the root partition by partition
    (`tasks.catalog.staging`), and their counts: decoded records, then the listing rejects and
    manifest problems, stamped with the source and the ingest id."""

    def __init__(self, plan: Plan, cat_layout: Layout, metadata_columns: list[str]) -> None:
        self.plan = plan
        folder = cat_layout.catalog_staging(plan.ingest_id)
        self.accepted = StagedRows(folder / "accepted", ACCEPTED_COLUMNS + metadata_columns)
        self.quarantine = StagedRows(folder / "quarantine", QUARANTINE_COLUMNS)
        self.quarantined: Counter[tuple[str, str]] = Counter()  # (step, reason): rows
        self._folder = folder
        self._stamp = {"source": plan.src, "ingest_id": plan.ingest_id}

    def add_records(self, records: list[dict]) -> None:
        """Stage one decode partition's records."""
        stamp, seq = self._stamp, self.plan.seq + 1
        self.accepted.add([{**r, **stamp, "ingest_seq": seq} for r in records if "reason" not in r])
        self._add_quarantine(
            [
                {**{k: r.get(k) for k in QUARANTINE_COLUMNS}, **stamp, "step": "ingest"}
                for r in records
                if "reason" in r
            ]
        )

    def add_listing_problems(self) -> None:
        """Stage the files rejected from the listing alone and the manifest's problems."""
        plan, stamp = self.plan, self._stamp
        for batch in plan.reject_batches():
            self._add_quarantine(
                [
                    {
                        "key": r["key"],
                        "reason": r["reason"],
                        "detail": r["detail"],
                        **stamp,
                        "step": "ingest",
                        "unit": r["key"],
                        "unit_version": r["version"],
                    }
                    for r in batch
                ]
            )
        for batch in plan.problem_batches():
            self._add_quarantine(
                [
                    {
                        **p,
                        **stamp,
                        "step": "ingest-manifest",
                        "unit": plan.manifest.name or "-",
                        "unit_version": plan.manifest.version,
                    }
                    for p in batch
                ]
            )

    def _add_quarantine(self, rows: list[dict]) -> None:
        self.quarantined.update((r["step"], r.get("reason")) for r in rows)
        self.quarantine.add(rows)

    def discard(self) -> None:
        shutil.rmtree(self._folder, ignore_errors=True)


def _commit_rows(cat_layout: Layout, plan: Plan, rows: _RunRows) -> dict[str, int | None]:
    """One commit per catalog table: this run's rows in, the rows of the units it replaced or
    found removed (and, for the quarantine, the source's old manifest problems) out."""
    prev = plan.prev_summary.get("table_versions", {})
    versions = {}
    for table, staged, replaced in (
        ("accepted", rows.accepted, Replaced(plan.src, plan.stale_between)),
        (
            "quarantine",
            rows.quarantine,
            Replaced(plan.src, plan.stale_between, ("ingest-manifest",)),
        ),
    ):
        versions[table] = commit_staged(cat_layout, table, staged, plan.seq + 1, replaced)
        release_freed_memory()  # the data files' row groups
        if versions[table] is None:
            versions[table] = prev.get(table)
    return versions


# -- phase 4: the run's counts and summary.json -----------------------------------------------


def _summarize(plan: Plan, rows: _RunRows) -> tuple[IngestResult, dict]:
    """(result, summary.json): this source's counts in the new view, and the run's delta."""
    c = plan.view_counts()
    mine_q = c["kept_files"] + rows.quarantined
    n_acc, n_q = rows.accepted.rows, rows.quarantine.rows
    before = plan.prev_summary
    totals = {  # the whole view: the previous totals, less what left it, plus this run's rows
        "view_accepted": int(before.get("view_accepted", 0))
        - c["accepted"]
        + c["kept_accepted"]
        + n_acc,
        "view_quarantined": int(before.get("view_quarantined", 0))
        - c["quarantined"]
        + sum(c["kept_files"].values())
        + n_q,
    }
    result = _result_for(
        plan.ingest_id,
        plan.src,
        plan.source_format,
        c["kept_accepted"] + n_acc,
        mine_q,
        totals,
        reused=False,
    )
    result.new_items, result.removed_items = plan.todo + plan.rejects, plan.removed
    result.unchanged_items = plan.listed - result.new_items
    result.decoded_accepted = n_acc
    result.decoded_quarantined = sum(
        n for (step, _), n in rows.quarantined.items() if step == "ingest"
    )
    assert result.listed == result.accepted + result.quarantined, "accepted + quarantined = listed"
    summary = {
        **result.to_dict(),
        "ingest_seq": plan.seq + 1,
        "previous": plan.previous,
        "settings": plan.settings,
        "superseded_accepted": c["accepted"] - c["kept_accepted"],
        "manifests": {**before.get("manifests", {}), plan.src: plan.manifest.version},
        "source_settings": {**before.get("source_settings", {}), plan.src: plan.settings},
        "removed": plan.removed_units(1000),
    }
    return result, summary


def _result_for(
    ingest_id: str,
    src: str,
    source_format: str,
    accepted: int,
    quarantined: Counter[tuple[str, str]],
    totals: dict,
    *,
    reused: bool,
) -> IngestResult:
    """The counts of `src` in the view: `accepted` rows, `quarantined` ones by (step, reason);
    `totals` has the whole view's (and, for a reused ingest, when it finished)."""
    reasons = Counter({reason: n for (step, reason), n in quarantined.items() if step == "ingest"})
    files_q = sum(reasons.values())
    return IngestResult(
        ingest_id=ingest_id,
        source=src,
        layout=source_format,
        listed=accepted + files_q,
        accepted=accepted,
        quarantined=files_q,
        reasons=dict(reasons),
        manifest_problems=sum(
            n for (step, _), n in quarantined.items() if step == "ingest-manifest"
        ),
        unchanged_items=accepted + files_q if reused else 0,
        view_accepted=int(totals.get("view_accepted", 0)),
        view_quarantined=int(totals.get("view_quarantined", 0)),
        reused=reused,
        finished_at=totals.get("finished_at") or datetime.now(UTC).isoformat(timespec="seconds"),
    )
