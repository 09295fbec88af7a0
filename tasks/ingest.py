"""Ingest: list a source in partitions, decode what is new, and keep an accumulating catalog.

Per run, `<root>/catalog/<ingest_id>/` gets:

* `listing.parquet`: every object the run saw (key, size, ETag or mtime);
* `accepted.parquet` and `quarantine.parquet`: only the rows this run decoded or rejected;
* `view_accepted.parquet` and `view_quarantine.parquet`: the current view, every row of every
  source ingested into this root that is still present (what validate reads);
* `summary.json`: counts, per-reason tallies and the incremental delta.

`<root>/catalog/LATEST` names the ingest whose view is current. A run compares the listing
with the view, item by item (key plus size and ETag or mtime, and the versions of its
sidecars or manifest row): unchanged items are not read again, changed ones replace their old
rows, and items gone from the source leave the view. A re-run over an unchanged source decodes
nothing and adds no rows.

Listing and decoding run as Prefect tasks over partitions: the top-level folders of the
source, and then chunks of `partition_size` items. Locally the decode tasks share a process
pool; with `dask_address` they run on a Dask cluster through prefect-dask's DaskTaskRunner.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
from collections import Counter
from concurrent.futures import Executor, ProcessPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.inspect import InspectOptions, inspect_item
from tasks.layout import Layout
from tasks.logs import task_logger
from tasks.runners import partition_runner
from tasks.sources import (
    CATALOG_COLUMNS,
    LAYOUTS,
    MANIFEST_NAMES,
    Item,
    detect_layout,
    plan_items,
    read_manifest,
)
from tasks.storage import ObjectInfo, Storage

__all__ = [
    "ACCEPTED_COLUMNS",
    "QUARANTINE_COLUMNS",
    "IngestResult",
    "decode_partition",
    "ingest_source",
    "list_partition",
    "read_view",
]

ACCEPTED_COLUMNS = CATALOG_COLUMNS
QUARANTINE_COLUMNS = [
    "key", "source", "reason", "detail", "step", "unit", "unit_version", "ingest_id",
]  # fmt: skip


@dataclass
class IngestResult:
    ingest_id: str
    source: str
    layout: str
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


def read_view(layout: Layout, ingest_id: str | None) -> tuple[pd.DataFrame, pd.DataFrame, int]:
    """(accepted, quarantine, ingest_seq) of the view after `ingest_id`; empty when None."""
    if ingest_id is None:
        return (
            pd.DataFrame(columns=ACCEPTED_COLUMNS),
            pd.DataFrame(columns=QUARANTINE_COLUMNS),
            0,
        )
    cat = layout.catalog(ingest_id)
    summary = json.loads((cat / "summary.json").read_text())
    return (
        pd.read_parquet(cat / "view_accepted.parquet"),
        pd.read_parquet(cat / "view_quarantine.parquet"),
        int(summary.get("ingest_seq", 0)),
    )


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


def _ingest_id(source: str, state: dict, delta: list[tuple[str, str]], removed: list) -> str:
    # `state` holds the previous ingest id, the manifest version and the settings, so that
    # every change of the view gets its own id and an id is never reused for other content.
    h = hashlib.sha256(json.dumps([source, state, delta, removed], sort_keys=True).encode())
    return "ing-" + h.hexdigest()[:12]


def _frame(rows: list[dict], columns: list[str]) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    for c in columns:
        if c not in df.columns:
            df[c] = None
    extra = [c for c in df.columns if c not in columns]
    df = df[columns + extra]
    return df.sort_values("key", kind="stable").reset_index(drop=True) if len(df) else df


def _write_dir(out: Path, tables: dict[str, pd.DataFrame], summary: dict) -> None:
    # Write into a temporary folder and rename it into place: a crash leaves no half catalog.
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, df in tables.items():
        df.to_parquet(tmp / f"{name}.parquet", index=False)
    (tmp / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def ingest_source(
    source: str,
    root: str,
    *,
    layout: str = "auto",
    metadata_file: str | None = None,
    caption_column: str = "text",
    metadata_columns: tuple[str, ...] = (),
    image_extensions: tuple[str, ...] = (".jpg", ".jpeg", ".png", ".webp"),
    max_pixels: int = 89_478_485,
    workers: int = 0,
    partition_size: int = 1000,
    endpoint_url: str | None = None,
    dask_address: str | None = None,
) -> IngestResult:
    """Catalog what is new or changed under `source` and update the current view.

    Must run where Prefect tasks can run (inside a flow, or standalone). Returns the run's
    counts; `reused` is true when nothing changed, and then no ingest id is created.
    """
    log = task_logger(__name__)
    if layout not in ("auto", *LAYOUTS):
        raise ValueError(f"ingest.layout must be auto or one of {LAYOUTS}, got {layout!r}")
    store = Storage(source, endpoint_url)
    if not store.is_s3 and not store.path.is_dir():
        raise FileNotFoundError(f"ingest source {source!r} does not exist")
    cat_layout = Layout(Path(root))
    exts = {e.lower() for e in image_extensions}
    n_workers = workers or os.cpu_count() or 1
    src = store.url()

    with ExitStack() as stack:
        runner = stack.enter_context(partition_runner(n_workers, dask_address))
        listing = _list_source(store, runner, endpoint_url)
        chosen = layout if layout != "auto" else detect_layout(listing, exts)
        manifest_obj = None
        if chosen == "imagefolder":
            names = [metadata_file] if metadata_file else list(MANIFEST_NAMES)
            manifest_obj = next((o for o in listing if o.key in names), None)
            if manifest_obj is None:
                log.warning("no manifest (%s) in %s: images will lack captions", names, src)
        manifest = read_manifest(store, manifest_obj, caption_column, list(metadata_columns))
        items, listing_rejects = plan_items(listing, chosen, manifest, exts)

        previous = cat_layout.latest_or_none("catalog")
        view_acc, view_q, seq = read_view(cat_layout, previous)
        mine_acc = view_acc[view_acc["source"] == src]
        mine_q = view_q[(view_q["source"] == src) & (view_q["step"] == "ingest")]
        known = dict(zip(mine_acc["unit"], mine_acc["unit_version"], strict=True))
        known.update(zip(mine_q["unit"], mine_q["unit_version"], strict=True))
        prev_summary = (
            json.loads((cat_layout.catalog(previous) / "summary.json").read_text())
            if previous
            else {}
        )
        settings = {
            "layout": chosen,
            "caption_column": caption_column,
            "metadata_columns": list(metadata_columns),
            "max_pixels": max_pixels,
        }
        source_settings = {**prev_summary.get("source_settings", {}), src: settings}
        if prev_summary.get("source_settings", {}).get(src, settings) != settings:
            # New caption or metadata columns, or another pixel limit: every row of this
            # source must be rebuilt, not only the changed files.
            log.info("ingest settings for %s changed: re-reading every item", src)
            known = {}
        todo = [it for it in items if known.get(it.key) != it.version]
        rejects = [r for r in listing_rejects if known.get(r["key"]) != r["version"]]
        present = {it.key for it in items} | {r["key"] for r in listing_rejects}
        removed = sorted((set(mine_acc["unit"]) | set(mine_q["unit"])) - present)
        manifests = {**prev_summary.get("manifests", {}), src: manifest.version}
        manifest_changed = prev_summary.get("manifests", {}).get(src) != manifest.version
        delta = [(it.key, it.version) for it in todo] + [(r["key"], r["version"]) for r in rejects]
        if not delta and not removed and not manifest_changed and previous is not None:
            log.info("source %s unchanged since %s: nothing to decode", src, previous)
            return _result_for(previous, src, chosen, view_acc, view_q, prev_summary, reused=True)

        state = {**settings, "previous": previous, "manifest": manifest.version}
        ingest_id = _ingest_id(src, state, delta, removed)
        opts = InspectOptions(src, endpoint_url, max_pixels, tuple(metadata_columns))
        log.info(
            "ingest %s (%s layout): %d items listed, %d new or changed, %d removed; decoding "
            "in partitions of %d on %s",
            ingest_id, chosen, len(items) + len(listing_rejects), len(todo), len(removed),
            partition_size, "Dask " + dask_address if dask_address else f"{n_workers} processes",
        )  # fmt: skip
        pool = None
        if not dask_address and todo:
            # spawn, not fork: the parent runs Prefect's threads, and forking those can deadlock.
            pool = stack.enter_context(
                ProcessPoolExecutor(min(n_workers, len(todo)), mp_context=mp.get_context("spawn"))
            )
        parts = [todo[i : i + partition_size] for i in range(0, len(todo), partition_size)]
        futures = [
            runner.submit(decode_partition, {"opts": opts, "items": p, "pool": pool}) for p in parts
        ]
        records = [r for f in futures for r in f.result()]

    seq += 1
    stamp = {"source": src, "ingest_id": ingest_id}
    accepted = [{**r, **stamp, "ingest_seq": seq} for r in records if "reason" not in r]
    quarantine = [
        {**{k: r.get(k) for k in QUARANTINE_COLUMNS}, **stamp, "step": "ingest"}
        for r in records if "reason" in r
    ] + [
        {**r, **stamp, "step": "ingest", "unit": r["key"], "unit_version": r.pop("version")}
        for r in rejects
    ]  # fmt: skip
    problems = [
        {**p, **stamp, "step": "ingest-manifest", "unit": manifest.name or "-",
         "unit_version": manifest.version}
        for p in manifest.problems
    ]  # fmt: skip
    acc_df = _frame(accepted, ACCEPTED_COLUMNS + list(metadata_columns))
    q_df = _frame(quarantine + problems, QUARANTINE_COLUMNS)

    # The new view: other sources untouched; this source's changed and removed units replaced.
    stale = {it.key for it in todo} | {r["key"] for r in rejects} | set(removed)
    keep_acc = view_acc[~((view_acc["source"] == src) & view_acc["unit"].isin(stale))]
    keep_q = view_q[
        ~(
            (view_q["source"] == src)
            & (view_q["unit"].isin(stale) | view_q["step"].eq("ingest-manifest"))
        )
    ]
    new_acc = _concat(keep_acc, acc_df)
    new_q = _concat(keep_q, q_df)
    result = _result_for(ingest_id, src, chosen, new_acc, new_q, {}, reused=False)
    result.new_items, result.removed_items = len(todo) + len(rejects), len(removed)
    result.unchanged_items = len(items) + len(listing_rejects) - result.new_items
    result.decoded_accepted = len(acc_df)
    result.decoded_quarantined = int((q_df["step"] == "ingest").sum()) if len(q_df) else 0
    mine = new_acc[new_acc["source"] == src]
    assert result.listed == len(mine) + result.quarantined, "accepted + quarantined = listed"
    summary = {**result.to_dict(), "ingest_seq": seq, "previous": previous,
               "settings": settings, "manifests": manifests,
               "source_settings": source_settings,
               "removed": removed[:1000]}  # fmt: skip
    seen = pd.DataFrame(
        [(o.key, o.size, o.version) for o in listing], columns=["key", "size", "version"]
    ).assign(source=src)
    _write_dir(
        cat_layout.catalog(ingest_id),
        {"accepted": acc_df, "quarantine": q_df, "view_accepted": new_acc,
         "view_quarantine": new_q, "listing": seen},
        summary,
    )  # fmt: skip
    cat_layout.set_latest("catalog", ingest_id)
    return result


def _concat(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    frames = [f for f in (a, b) if len(f)]
    if not frames:
        return b if len(b.columns) >= len(a.columns) else a
    out = pd.concat(frames, ignore_index=True)
    return out.sort_values(["source", "key"], kind="stable").reset_index(drop=True)


def _result_for(
    ingest_id: str,
    src: str,
    layout: str,
    acc: pd.DataFrame,
    q: pd.DataFrame,
    prev: dict,
    *,
    reused: bool,
) -> IngestResult:
    mine_acc = acc[acc["source"] == src]
    mine_q = q[q["source"] == src]
    files_q = mine_q[mine_q["step"] == "ingest"]
    return IngestResult(
        ingest_id=ingest_id,
        source=src,
        layout=layout,
        listed=len(mine_acc) + len(files_q),
        accepted=len(mine_acc),
        quarantined=len(files_q),
        reasons=dict(Counter(files_q["reason"])),
        manifest_problems=int((mine_q["step"] == "ingest-manifest").sum()),
        unchanged_items=len(mine_acc) + len(files_q) if reused else 0,
        view_accepted=len(acc),
        view_quarantined=len(q),
        reused=reused,
        finished_at=prev.get("finished_at") or datetime.now(UTC).isoformat(timespec="seconds"),
    )
