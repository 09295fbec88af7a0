"""Compaction after every N ingests: the ingest flow's hook around `kiln catalog compact`.

An ingest that committed rows (not one that found its source unchanged) and whose `ingest_seq`
is a multiple of `ingest.compact_every` runs `compact_catalog`: the same bin-packing and
vacuum as the command (`tasks.catalog.admin.compact`), with the same horizon
(`ingest.compact_retain_hours`, the command's default) and the same protection of every
version a registered model's dataset version was cut from.

The ingest has committed before compaction starts, so a compaction that fails (a concurrent
writer's commit conflicting with it, a table it cannot read) loses nothing: it is logged as a
warning, reported in the ingest's result and artifact, and the flow succeeds. The next due
ingest, or the command, compacts again.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.catalog.admin import compact, registered_versions
from tasks.runtime.logs import task_logger
from tasks.storage.layout import Layout

__all__ = ["compact_after_ingest", "compact_catalog", "compaction_due"]


def compaction_due(root: str, ingest_id: str | None, reused: bool, every: int) -> int | None:
    """The `ingest_seq` of `ingest_id` when compaction is due after it, else None.

    Args:
        root: The storage root.
        ingest_id: The ingest that just ran.
        reused: True when it found its source unchanged and committed nothing.
        every: `ingest.compact_every`; 0 never compacts.
    """
    if every == 0 or reused or ingest_id is None:
        return None
    summary = Layout(Path(root)).catalog(ingest_id) / "summary.json"
    seq = int(json.loads(summary.read_text())["ingest_seq"])
    return seq if seq % every == 0 else None


def _protected(root: str, tracking_uri: str, model_name: str) -> dict[str, int]:
    """The table versions vacuum must keep for registered models (`registered_versions`).
    A root without any dataset version has none, and the registry is not asked."""
    if not any(Layout(Path(root)).folder("shards").glob("*/shards.json")):
        return {}
    return registered_versions(root, tracking_uri, model_name)


@task(name="compact-catalog", cache_policy=NO_CACHE)
def compact_catalog(root: str, retain_hours: float, tracking_uri: str, model_name: str) -> dict:
    """Compact and vacuum the catalog's tables as `kiln catalog compact` does; returns, per
    table, the files and bytes optimize removed and added, the files and bytes vacuum
    deleted, the horizon it used and the table's version after it."""
    log = task_logger(__name__)
    keep = _protected(root, tracking_uri, model_name)
    done = compact(root, retain_hours, keep)
    for table, d in done.items():
        log.info(
            "compacted %s: %d files (%d bytes) into %d (%d bytes); vacuumed %d files (%d "
            "bytes) older than %d h; now version %d",
            table,
            d["files_removed"],
            d["bytes_removed"],
            d["files_added"],
            d["bytes_added"],
            d["vacuumed"],
            d["vacuumed_bytes"],
            d["retain_hours"],
            d["version"],
        )
    return done


def compact_after_ingest(
    root: str,
    ingest_id: str | None,
    reused: bool,
    *,
    every: int,
    retain_hours: float,
    tracking_uri: str,
    model_name: str,
) -> dict | None:
    """Run `compact_catalog` when it is due after this ingest (`compaction_due`); must run
    inside a flow. Returns None when not due, else `{"ingest_seq", "tables"}` or, when it
    failed, `{"ingest_seq", "error"}` (logged as a warning; the ingest stays committed).

    Args:
        root: The storage root.
        ingest_id: The ingest that just ran.
        reused: True when it found its source unchanged.
        every: `ingest.compact_every`.
        retain_hours: `ingest.compact_retain_hours`.
        tracking_uri: The registry whose models' dataset versions vacuum keeps.
        model_name: The registered model to look up.
    """
    seq = compaction_due(root, ingest_id, reused, every)
    if seq is None:
        return None
    state = compact_catalog(root, retain_hours, tracking_uri, model_name, return_state=True)
    if state.is_completed():
        return {"ingest_seq": seq, "tables": state.result()}
    error = state.result(raise_on_failure=False)
    message = (
        f"{type(error).__name__}: {error}"
        if isinstance(error, BaseException)
        else (state.message or str(state.type))
    )
    task_logger(__name__).warning(
        "catalog compaction after ingest %s (ingest_seq %d) failed; the ingest is committed "
        "and the next due ingest or `kiln catalog compact` compacts again: %s",
        ingest_id,
        seq,
        message,
    )
    return {"ingest_seq": seq, "error": message}
