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
from the source leave the view. A re-run over an
unchanged source decodes nothing and adds no rows.

Listing and decoding run as Prefect tasks over partitions: the top-level folders of the
source, and then chunks of `partition_size` items. Locally the decode tasks share a process
pool; with `dask_address` they run on a Dask cluster through prefect-dask's DaskTaskRunner.

`ingest_source` runs the phases in order: list the source and compare it with the view
(`_plan_run`), decode the new and changed items (`_decode`), staging each partition's rows on
disk as it finishes (`_RunRows`, so memory does not grow with the items decoded), count the
view after them (`_summarize`), commit the staged rows (`_commit_rows`, streamed into the
tables) and write the catalog folder (`write_catalog_dir`).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from kiln_config.errors import InputError, MissingInput
from tasks.catalog.staging import Replaced, StagedRows, commit_staged
from tasks.catalog.view import (
    ACCEPTED_COLUMNS,
    QUARANTINE_COLUMNS,
    read_view,
    scan_view,
    write_catalog_dir,
)
from tasks.ingest.inspect import InspectOptions, inspect_item
from tasks.ingest.sources import (
    MANIFEST_NAMES,
    SOURCE_FORMATS,
    Item,
    Manifest,
    detect_source_format,
    plan_items,
    read_manifest,
)
from tasks.runtime.logs import task_logger
from tasks.runtime.progress import Progress
from tasks.runtime.runners import partition_runner
from tasks.storage.layout import Layout
from tasks.storage.lock import catalog_writer
from tasks.storage.objects import ObjectInfo, Storage

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


@task(name="list-partition", retries=3, retry_delay_seconds=2, cache_policy=NO_CACHE)
def list_partition(source: str, prefix: str, endpoint_url: str | None = None) -> list[ObjectInfo]:
    """Every object below one top-level folder of the source (S3 listing paginates)."""
    return Storage(source, endpoint_url).list(prefix)


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
    cfg: IngestConfig, store: Storage, root: str, endpoint_url: str | None,
    dask_address: str | None,
) -> IngestResult:  # fmt: skip
    log = task_logger(__name__)
    cat_layout = Layout(Path(root))
    n_workers = cfg.workers or os.cpu_count() or 1
    with ExitStack() as stack:
        runner = stack.enter_context(partition_runner(n_workers, dask_address))
        listing = _list_source(store, runner, endpoint_url)
        plan = _plan_run(store, listing, cfg, cat_layout)
        if plan.ingest_id is None:
            log.info("source %s unchanged since %s: nothing to decode", plan.src, plan.previous)
            mine_q = Counter(zip(plan.mine_q["step"], plan.mine_q["reason"], strict=True))
            return _result_for(plan.previous, plan.src, plan.source_format, len(plan.mine_acc),
                               mine_q, plan.prev_summary, reused=True)  # fmt: skip
        log.info(
            "ingest %s (%s source): %d items listed, %d new or changed, %d removed; decoding "
            "in partitions of %d on %s",
            plan.ingest_id, plan.source_format, plan.listed, len(plan.todo), len(plan.removed),
            cfg.partition_size,
            "Dask " + dask_address if dask_address else f"{n_workers} processes",
        )  # fmt: skip
        opts = InspectOptions(plan.src, endpoint_url, cfg.max_pixels,
                              tuple(cfg.metadata_columns), tuple(cfg.image_extensions))  # fmt: skip
        pool = None
        if not dask_address and plan.todo:
            # spawn, not fork: the parent runs Prefect's threads, and forking those can deadlock.
            pool = stack.enter_context(ProcessPoolExecutor(
                min(n_workers, len(plan.todo)), mp_context=mp.get_context("spawn")))  # fmt: skip
        rows = _RunRows(plan, cat_layout, list(cfg.metadata_columns))
        stack.callback(rows.discard)
        _decode(plan.todo, opts, runner, pool, cfg.partition_size, rows.add_records)
        rows.add_listing_problems()
        result, summary = _summarize(plan, rows)
        summary["table_versions"] = _commit_rows(cat_layout, plan, rows)
    write_catalog_dir(
        cat_layout.catalog(plan.ingest_id),
        {"listing": _listing_delta(plan),
         "superseded": pd.DataFrame({"unit": sorted(plan.stale)}, dtype=object)},
        summary,
    )  # fmt: skip
    cat_layout.set_latest("catalog", plan.ingest_id)
    return result


# -- phase 1: the source and its listing, compared with the current view ----------------------


@dataclass
class _Plan:
    """One run's work: what the source holds now, against the view of the previous ingest."""

    src: str
    source_format: str
    listing: list[ObjectInfo]
    manifest: Manifest
    items: list[Item]  # every item of the source now
    listing_rejects: list[dict]  # files quarantined from the listing alone
    settings: dict  # the ingest settings this source's rows were built with
    previous: str | None  # the ingest whose view this run starts from
    prev_summary: dict
    mine_acc: pd.DataFrame  # this source's accepted rows in that view: unit, unit_version
    mine_q: pd.DataFrame  # and its quarantined ones: unit, unit_version, step, reason
    seq: int
    todo: list[Item]  # new or changed items: decoded this run
    rejects: list[dict]  # new or changed listing rejects
    removed: list[str]  # units gone from the source
    ingest_id: str | None  # None: nothing changed, the previous ingest stays current

    @property
    def listed(self) -> int:
        return len(self.items) + len(self.listing_rejects)

    @property
    def stale(self) -> set[str]:
        """Units whose rows in the view this run replaces or removes."""
        return {it.key for it in self.todo} | {r["key"] for r in self.rejects} | set(self.removed)


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


def _list_source(store: Storage, runner, endpoint_url: str | None) -> list[ObjectInfo]:
    dirs, top = store.top_level()
    futures = [
        runner.submit(
            list_partition, {"source": store.url(), "prefix": d, "endpoint_url": endpoint_url}
        )
        for d in dirs
    ]
    listing = top + [o for f in futures for o in f.result()]
    return sorted(listing, key=lambda o: o.key)


def _read_source(
    store: Storage, listing: list[ObjectInfo], cfg: IngestConfig
) -> tuple[str, Manifest, list[Item], list[dict]]:
    """(source format, manifest, items, listing rejects) of the source as listed."""
    exts = {e.lower() for e in cfg.image_extensions}
    chosen = cfg.layout if cfg.layout != "auto" else detect_source_format(listing, exts)
    manifest_obj = None
    if chosen == "imagefolder":
        names = [cfg.metadata_file] if cfg.metadata_file else list(MANIFEST_NAMES)
        manifest_obj = next((o for o in listing if o.key in names), None)
        if manifest_obj is None:
            task_logger(__name__).warning(
                "no manifest (%s) in %s: images will lack captions", names, store.url()
            )
    manifest = read_manifest(store, manifest_obj, cfg.caption_column, list(cfg.metadata_columns))
    items, listing_rejects = plan_items(listing, chosen, manifest, exts)
    return chosen, manifest, items, listing_rejects


def _plan_run(
    store: Storage, listing: list[ObjectInfo], cfg: IngestConfig, cat_layout: Layout
) -> _Plan:
    """Compare the listing with the view, item by item: what to decode, what is gone."""
    src = store.url()
    chosen, manifest, items, listing_rejects = _read_source(store, listing, cfg)
    previous = cat_layout.latest_or_none("catalog")
    prev_summary = (
        json.loads((cat_layout.catalog(previous) / "summary.json").read_text()) if previous else {}
    )
    seq = int(prev_summary.get("ingest_seq", 0))
    mine_acc, mine_q = _source_rows(cat_layout, previous, src)
    files_q = mine_q[mine_q["step"] == "ingest"]
    known = dict(zip(mine_acc["unit"], mine_acc["unit_version"], strict=True))
    known.update(zip(files_q["unit"], files_q["unit_version"], strict=True))
    settings = {
        "layout": chosen,
        "caption_column": cfg.caption_column,
        "metadata_columns": list(cfg.metadata_columns),
        "max_pixels": cfg.max_pixels,
        # They decide which tar members are images.
        "image_extensions": sorted({e.lower() for e in cfg.image_extensions}),
    }
    if prev_summary.get("source_settings", {}).get(src, settings) != settings:
        # New caption or metadata columns, another pixel limit or other extensions: every row
        # of this source must be rebuilt, not only the changed files.
        task_logger(__name__).info("ingest settings for %s changed: re-reading every item", src)
        known = {}
    todo = [it for it in items if known.get(it.key) != it.version]
    rejects = [r for r in listing_rejects if known.get(r["key"]) != r["version"]]
    present = {it.key for it in items} | {r["key"] for r in listing_rejects}
    removed = sorted((set(mine_acc["unit"]) | set(files_q["unit"])) - present)
    manifest_changed = prev_summary.get("manifests", {}).get(src) != manifest.version
    delta = [(it.key, it.version) for it in todo] + [(r["key"], r["version"]) for r in rejects]
    ingest_id = None
    if delta or removed or manifest_changed or previous is None:
        state = {**settings, "previous": previous, "manifest": manifest.version}
        ingest_id = _ingest_id(src, state, delta, removed)
    return _Plan(
        src=src, source_format=chosen, listing=listing, manifest=manifest, items=items,
        listing_rejects=listing_rejects, settings=settings, previous=previous,
        prev_summary=prev_summary, mine_acc=mine_acc, mine_q=mine_q, seq=seq, todo=todo,
        rejects=rejects, removed=removed, ingest_id=ingest_id,
    )  # fmt: skip


def _source_rows(
    cat_layout: Layout, ingest_id: str | None, src: str
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(accepted, quarantined) rows of `src` in the view after `ingest_id`: a scan of the
    source's own ingests, four narrow columns, never the other sources' rows."""
    frames = []
    for table, cols in (("accepted", ["unit", "unit_version"]),
                        ("quarantine", ["unit", "unit_version", "step", "reason"])):  # fmt: skip
        got = list(scan_view(cat_layout, ingest_id, table, cols, sources={src}))
        frames.append(pd.concat(got, ignore_index=True) if got else pd.DataFrame(columns=cols))
    return frames[0], frames[1]


def _ingest_id(source: str, state: dict, delta: list[tuple[str, str]], removed: list) -> str:
    # `state` holds the previous ingest id, the manifest version and the settings, so that
    # every change of the view gets its own id and an id is never reused for other content.
    h = hashlib.sha256(json.dumps([source, state, delta, removed], sort_keys=True).encode())
    return "ing-" + h.hexdigest()[:12]


# -- phase 2: decode the new and changed items in partitions ----------------------------------


def _decode(
    todo: list[Item],
    opts: InspectOptions,
    runner,
    pool: Executor | None,
    partition_size: int,
    sink: Callable[[list[dict]], None],
) -> None:
    """One decode task per partition of `partition_size` items; each partition's records go to
    `sink` as it finishes, in order, and are then let go (the driver holds a few partitions'
    records at a time, not the run's)."""
    parts = [todo[i : i + partition_size] for i in range(0, len(todo), partition_size)]
    futures = deque(
        runner.submit(decode_partition, {"opts": opts, "items": p, "pool": pool}) for p in parts
    )
    progress = Progress("ingest", len(todo), "items")
    for p in parts:
        sink(futures.popleft().result())
        progress.advance(len(p))
    progress.finish()


# -- phase 3: the run's rows, merged into the view ---------------------------------------------


class _RunRows:
    """This run's (accepted, quarantine) rows, staged under the root partition by partition
    (`tasks.catalog.staging`), and their counts: decoded records, then the listing rejects and
    manifest problems, stamped with the source and the ingest id."""

    def __init__(self, plan: _Plan, cat_layout: Layout, metadata_columns: list[str]) -> None:
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
        self._add_quarantine([
            {**{k: r.get(k) for k in QUARANTINE_COLUMNS}, **stamp, "step": "ingest"}
            for r in records if "reason" in r
        ])  # fmt: skip

    def add_listing_problems(self) -> None:
        """Stage the files rejected from the listing alone and the manifest's problems."""
        plan, stamp = self.plan, self._stamp
        self._add_quarantine([
            {**{k: v for k, v in r.items() if k != "version"}, **stamp, "step": "ingest",
             "unit": r["key"], "unit_version": r["version"]}
            for r in plan.rejects
        ] + [
            {**p, **stamp, "step": "ingest-manifest", "unit": plan.manifest.name or "-",
             "unit_version": plan.manifest.version}
            for p in plan.manifest.problems
        ])  # fmt: skip

    def _add_quarantine(self, rows: list[dict]) -> None:
        self.quarantined.update((r["step"], r.get("reason")) for r in rows)
        self.quarantine.add(rows)

    def discard(self) -> None:
        shutil.rmtree(self._folder, ignore_errors=True)


def _listing_delta(plan: _Plan) -> pd.DataFrame:
    """The listed objects of the units this run decoded or rejected (with their sidecars),
    and the manifest when it changed."""
    keys = {r["key"] for r in plan.rejects}
    for it in plan.todo:
        keys.update(k for k in (it.key, it.txt, it.json) if k)
    if plan.manifest.name and plan.prev_summary.get("manifests", {}).get(plan.src) != (
        plan.manifest.version
    ):
        keys.add(plan.manifest.name)
    return pd.DataFrame(
        [(o.key, o.size, o.version) for o in plan.listing if o.key in keys],
        columns=["key", "size", "version"],
    ).assign(source=plan.src)


def _commit_rows(cat_layout: Layout, plan: _Plan, rows: _RunRows) -> dict[str, int | None]:
    """One commit per catalog table: this run's rows in, the rows of the units it replaced or
    found removed (and, for the quarantine, the source's old manifest problems) out."""
    stale = sorted(plan.stale)
    prev = plan.prev_summary.get("table_versions", {})
    versions = {}
    for table, staged, replaced in (
        ("accepted", rows.accepted, Replaced(plan.src, stale)),
        ("quarantine", rows.quarantine, Replaced(plan.src, stale, ("ingest-manifest",))),
    ):
        versions[table] = commit_staged(cat_layout, table, staged, plan.seq + 1, replaced)
        if versions[table] is None:
            versions[table] = prev.get(table)
    return versions


# -- phase 4: the run's counts and summary.json -----------------------------------------------


def _summarize(plan: _Plan, rows: _RunRows) -> tuple[IngestResult, dict]:
    """(result, summary.json): this source's counts in the new view, and the run's delta."""
    stale = plan.stale
    keep_acc = plan.mine_acc[~plan.mine_acc["unit"].isin(stale)]
    old_q = plan.mine_q
    keep_q = old_q[(old_q["step"] == "ingest") & ~old_q["unit"].isin(stale)]
    mine_q = Counter(zip(keep_q["step"], keep_q["reason"], strict=True)) + rows.quarantined
    n_acc, n_q = rows.accepted.rows, rows.quarantine.rows
    before = plan.prev_summary
    totals = {  # the whole view: the previous totals, less what left it, plus this run's rows
        "view_accepted": int(before.get("view_accepted", 0)) - len(plan.mine_acc)
        + len(keep_acc) + n_acc,
        "view_quarantined": int(before.get("view_quarantined", 0)) - len(old_q) + len(keep_q)
        + n_q,
    }  # fmt: skip
    result = _result_for(plan.ingest_id, plan.src, plan.source_format, len(keep_acc) + n_acc,
                         mine_q, totals, reused=False)  # fmt: skip
    result.new_items, result.removed_items = len(plan.todo) + len(plan.rejects), len(plan.removed)
    result.unchanged_items = plan.listed - result.new_items
    result.decoded_accepted = n_acc
    result.decoded_quarantined = sum(n for (step, _), n in rows.quarantined.items()
                                     if step == "ingest")  # fmt: skip
    assert result.listed == result.accepted + result.quarantined, "accepted + quarantined = listed"
    summary = {
        **result.to_dict(),
        "ingest_seq": plan.seq + 1,
        "previous": plan.previous,
        "settings": plan.settings,
        "superseded_accepted": len(plan.mine_acc) - len(keep_acc),
        "manifests": {**before.get("manifests", {}), plan.src: plan.manifest.version},
        "source_settings": {**before.get("source_settings", {}), plan.src: plan.settings},
        "removed": plan.removed[:1000],
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
        ),  # fmt: skip
        unchanged_items=accepted + files_q if reused else 0,
        view_accepted=int(totals.get("view_accepted", 0)),
        view_quarantined=int(totals.get("view_quarantined", 0)),
        reused=reused,
        finished_at=totals.get("finished_at") or datetime.now(UTC).isoformat(timespec="seconds"),
    )
