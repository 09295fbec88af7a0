"""Validate: run the Great Expectations suite on a catalog and quarantine the failing rows.

The suite runs on the current catalog view (every source ingested into the root), so exact
and near duplicates are caught across runs. The row-local rules run a partition of the view
at a time (`check_partition`, Prefect tasks on local threads or a Dask cluster), so memory is
set by the partition size; the cross-catalog rules then run over the view's hashes (about 24
bytes a row). Rows that an earlier verdict in the same chain already checked under the same
suite are not checked again: a new ingest's rows are checked, and compared with the rest for
duplicates (`validate_catalog`).

Outputs are listed in `validate_catalog`; the quarantine is written before the gate is
checked, so a failing gate still leaves every reason on disk. The gate's verdict is written
with the catalog (`catalog/<ingest_id>/verdict.json`), and the shard step refuses a catalog
whose verdict is missing or failed unless told otherwise (`gate_for_sharding`). The clean
rows are the view less the verdict's rejects (`scan_clean`); nothing view-sized is written.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from prefect import task
from prefect.cache_policies import NO_CACHE

from data_quality.dup_partitions import write_hash_file
from data_quality.suite import (
    INGEST_REASONS,
    REASONS,
    SAMPLE,
    TERMS_REASONS,
    CrossCheck,
    RowCheck,
    check_columns,
    check_rows,
    cross_catalog,
    cross_hits,
    expectation_summaries,
    hash128,
    hash_columns,
    suite_key,
    write_data_docs,
)
from data_quality.terms import check_terms
from kiln_config import KilnError, QualityConfig
from kiln_config.errors import MissingInput
from tasks.catalog.takedown import takedown_set
from tasks.catalog.view import (
    ROW_GROUP,
    ViewPart,
    accepted_columns,
    chain,
    read_part,
    table_path,
    view_parts,
    view_versions,
)
from tasks.quality import hash_cache
from tasks.quality.dup_search import dup_partitions_for, old_hash_batches, partitioned_cross
from tasks.quality.verdict_rows import (
    FLAG_SCHEMA,
    REJECT_SCHEMA,
    merge_base,
    quarantine_schema,
    resolve_hits,
    stage_rejects,
    write_quarantine,
    write_rows,
    write_verdict_table,
)
from tasks.runtime.logs import task_logger
from tasks.runtime.progress import Progress
from tasks.runtime.runners import partition_runner, release_freed_memory
from tasks.storage.layout import Layout
from tasks.storage.lock import catalog_writer

__all__ = [
    "PARTITION_ROWS",
    "REJECTS_FILE",
    "VERDICT_FILE",
    "QualityGateError",
    "ValidateResult",
    "check_partition",
    "gate_for_sharding",
    "read_clean",
    "read_verdict",
    "reasons_table",
    "scan_clean",
    "validate_catalog",
]

VERDICT_FILE = "verdict.json"  # in catalog/<ingest_id>/, beside the two files below
REJECTS_FILE = "rejects.parquet"  # the view's rows the validate step quarantined
FLAGS_FILE = "near_duplicates.parquet"  # near-duplicates kept (not dropped): near_duplicate_of
SAMPLE_FILE = "docs_sample.parquet"  # the failing rows the Data Docs show (bounded)
PARTITION_ROWS = 2 * ROW_GROUP  # rows per validate task
OVERRIDE_FLAG = "--allow-failed-gate"


class QualityGateError(KilnError, RuntimeError):
    """Too large a fraction of the input was rejected."""


@dataclass
class ValidateResult:
    ingest_id: str
    listed: int
    clean: int
    rejected_ingest: int
    rejected_validate: int
    reject_fraction: float
    max_reject_fraction: float
    reasons: dict[str, int] = field(default_factory=dict)
    manifest_problems: int = 0
    near_duplicates: int = 0
    expectations: list[dict] = field(default_factory=list)
    data_docs: str | None = None
    checked_rows: int = 0  # rows the row-local rules ran on in this run
    incremental_from: str | None = None  # the verdict whose checked rows this run kept
    takedowns: int = 0  # rows quarantined as on the takedown list
    license_expired: int = 0  # rows quarantined as their license had ended (or had no date)

    @property
    def passed(self) -> bool:
        return self.reject_fraction <= self.max_reject_fraction

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def reasons_table(reasons: dict[str, int]) -> str:
    """A markdown table of quarantine reasons ({reason: files}) with counts."""
    lines = ["| reason | files | meaning |", "|---|---:|---|"]
    for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        meaning = {**INGEST_REASONS, **TERMS_REASONS, **REASONS}.get(reason, "")
        lines.append(f"| `{reason}` | {n} | {meaning} |")
    return "\n".join(lines)


def _write_parquet(df: pd.DataFrame, path: Path) -> None:
    tmp = path.with_suffix(".parquet.tmp")
    df.to_parquet(tmp, index=False)
    tmp.replace(path)


def _write_verdict(path: Path, result: ValidateResult, **extra) -> None:
    """The gate's verdict, written atomically (a reader sees the old file or the new one)."""
    verdict = {
        "ingest_id": result.ingest_id,
        "passed": result.passed,
        "reject_fraction": result.reject_fraction,
        "max_reject_fraction": result.max_reject_fraction,
        "listed": result.listed,
        "clean": result.clean,
        "reasons": result.reasons,
        "validated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        **extra,
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(verdict, indent=2))
    tmp.replace(path)


def read_verdict(root: str, ingest_id: str) -> dict | None:
    """The quality verdict recorded with a catalog, or None when it was never validated."""
    path = Layout(Path(root)).catalog(ingest_id) / VERDICT_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def gate_for_sharding(root: str, ingest_id: str, *, allow_failed_gate: bool = False) -> dict:
    """Check the catalog's recorded verdict before it is sharded; return its lineage record.

    The record (`passed`, `overridden`, reject fraction, limit and reasons) goes into the
    dataset version's `shards.json`.

    Raises:
        QualityGateError: the verdict failed or is missing, and `allow_failed_gate` is false.
    """
    log = task_logger(__name__)
    path = Layout(Path(root)).catalog(ingest_id) / VERDICT_FILE
    verdict = read_verdict(root, ingest_id)
    if verdict is None:
        if not allow_failed_gate:
            raise QualityGateError(
                f"catalog {ingest_id} has no quality verdict ({path} missing): run "
                f"`kiln validate` first, or pass {OVERRIDE_FLAG} (allow_failed_gate) to shard "
                "it unchecked"
            )
        log.warning("sharding %s without a quality verdict (%s)", ingest_id, OVERRIDE_FLAG)
        return {"passed": None, "overridden": True, "verdict": None, "reasons": {}}
    record = {
        "passed": bool(verdict["passed"]),
        "overridden": False,
        "verdict": str(path),
        "reject_fraction": verdict["reject_fraction"],
        "max_reject_fraction": verdict["max_reject_fraction"],
        "reasons": verdict["reasons"],
    }
    if record["passed"]:
        return record
    summary = (
        f"catalog {ingest_id} failed the quality gate: rejected "
        f"{verdict['reject_fraction']:.1%} of {verdict['listed']} files > "
        f"quality.max_reject_fraction ({verdict['max_reject_fraction']:.1%})"
    )
    if not allow_failed_gate:
        raise QualityGateError(
            f"{summary}; refusing to shard it.\n{reasons_table(verdict['reasons'])}\n"
            f"Fix the source or the quality settings and run `kiln validate` again, or pass "
            f"{OVERRIDE_FLAG} (allow_failed_gate) to shard it anyway; the override is recorded "
            "in the dataset's shards.json."
        )
    log.warning("%s; sharding it anyway (%s)", summary, OVERRIDE_FLAG)
    return {**record, "overridden": True}


@task(name="check-partition", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def check_partition(
    part: ViewPart,
    row_groups: list[int],
    columns: list[str],
    rules: QualityConfig,
    hash_path: str | None = None,
    hash_parts: int = 0,
    stage_path: str | None = None,
    cache: str | None = None,
) -> RowCheck:
    """The row-local rules on some row groups of one ingest's rows (a retry rewrites what it
    wrote; on a Dask worker, the root must be mounted at the same path). With `hash_path`, the
    rows' hashes go to that file for the partitioned duplicate search instead of the result;
    with `stage_path`, the rejected rows go to that file and the result keeps their `pos`;
    with `cache`, the hashes are also kept there for later validates (hash_cache.py)."""
    check = check_rows(read_part(part, columns, row_groups), rules)
    if cache:
        meta = pq.ParquetFile(part.path).metadata
        try:
            hash_cache.save(
                Path(cache),
                part.path,
                row_groups,
                [meta.row_group(g).num_rows for g in row_groups],
                check.hashes,
            )
        except OSError as e:  # the cache only saves time: a validate without it is the same
            task_logger(__name__).warning("hash cache not written (%s): %s", cache, e)
    if hash_path:
        write_hash_file(hash_path, check.hashes, hash_parts)
        check.hashes = None
    if stage_path:
        check.rejected = stage_rejects(stage_path, check.rejected)
    return check


def _partitions(parts: list[ViewPart], rows: int) -> list[tuple[ViewPart, list[int]]]:
    per = max(1, rows // ROW_GROUP)
    return [
        (p, list(range(g, min(g + per, p.row_groups))))
        for p in parts
        for g in range(0, p.row_groups, per)
    ]


def _base(layout: Layout, links: list[dict], key: str) -> dict | None:
    """The newest verdict in the chain reached under the suite `key`, when no accepted row
    left the view after it: its rows need no second check."""
    for s in reversed(links):
        folder = layout.catalog(s["id"])
        v = (
            json.loads((folder / VERDICT_FILE).read_text())
            if (folder / VERDICT_FILE).is_file()
            else None
        )
        if v and v.get("suite") == key and (folder / REJECTS_FILE).is_file():
            return {
                **v,
                "id": s["id"],
                "seq": int(s["ingest_seq"]),
                "rejects": folder / REJECTS_FILE,
                "flags": folder / FLAGS_FILE,
                "sample": pd.read_parquet(folder / SAMPLE_FILE),
            }
        if s.get("superseded_accepted", 1):  # older catalogs do not say: assume some left
            return None
    return None


def _run_checks(
    tasks: list,
    rules,
    columns,
    workers: int,
    dask_address: str | None,
    stage: Path,
    hash_dir: Path | None = None,
    hash_parts: int = 0,
    cache: Path | None = None,
) -> tuple[list, pd.DataFrame]:
    """check_partition over `tasks`, in order; at most `workers` partitions in flight locally,
    so that memory stays a few partitions whatever the catalog's size. Each writes its
    rejects to `stage/rows-<n>.parquet`; with `hash_dir`, its hashes there (`<n>.parquet`) for
    `hash_parts` duplicate partitions; with `cache`, to the hash cache. Returns the results
    and their bounded sample."""
    out, window, sample = [], [], pd.DataFrame()
    progress = Progress(
        "validate", sum(p.rows for p in {p.path: p for p, _ in tasks}.values()), "rows"
    )

    def done(future) -> None:
        nonlocal sample
        out.append(future.result())
        sample, out[-1].sample = _bounded_sample([sample, out[-1].sample]), None
        progress.advance(out[-1].rows)

    with partition_runner(workers, dask_address) as runner:
        limit = len(tasks) if dask_address else workers
        for i, (part, groups) in enumerate(tasks):
            args = {
                "part": part,
                "row_groups": groups,
                "columns": columns,
                "rules": rules,
                "stage_path": str(stage / f"rows-{i:06d}.parquet"),
                "cache": str(cache) if cache else None,
            }
            if hash_dir is not None:
                args.update(hash_path=str(hash_dir / f"{i:06d}.parquet"), hash_parts=hash_parts)
            window.append(runner.submit(check_partition, args))
            if len(window) >= limit:
                done(window.pop(0))
        for f in window:
            done(f)
    progress.finish()
    return out, sample


def _merge(checks: list[RowCheck], offset: int, sample: pd.DataFrame) -> RowCheck:
    """The partitions' results as one: the rejected rows' positions (`pos`, counted from
    `offset`; the rows themselves are staged), counts, `sample` and hashes."""
    pos, counts, start = [], {}, offset
    for c in checks:
        pos.append(c.rejected["pos"].to_numpy(np.int64) + start)
        for r, n in c.counts.items():
            counts[r] = counts.get(r, 0) + n
        start += c.rows
    hashes = (
        None
        if any(c.hashes is None for c in checks)
        else tuple(
            np.concatenate([c.hashes[i] for c in checks]) if checks else np.zeros(0, np.uint64)
            for i in range(3)
        )
    )
    rejected = pd.DataFrame({"pos": np.concatenate(pos) if pos else np.zeros(0, np.int64)})
    return RowCheck(
        rows=start - offset, rejected=rejected, counts=counts, sample=sample, hashes=hashes
    )


def _bounded_sample(frames: list[pd.DataFrame]) -> pd.DataFrame:
    frames = [f for f in frames if f is not None and len(f)]
    if not frames:
        return pd.DataFrame()
    cols = list(dict.fromkeys(c for f in frames for c in f.columns))
    return pd.concat([f.reindex(columns=cols) for f in frames], ignore_index=True).head(
        SAMPLE * len(REASONS)
    )


def _terms(
    root: str, parts: list[ViewPart], columns: list[str], rules: QualityConfig, out: Path
) -> pa.Array:
    """The licensing terms (data_quality/terms.py) on every row of the view, a row group at a
    time: the takedown list and the date change between runs, so no verdict is reused. The
    rows they quarantine go to `out`; returns their source and key joined by a NUL."""
    want = ["source", "key"] + [
        c for c in (rules.contributor_column, rules.license_end_column) if c in columns
    ]
    takedowns, today = takedown_set(root), datetime.now(UTC).date()
    if not takedowns and rules.license_end_column not in columns:
        parts = []  # no takedown list and no license end: no row can fail the terms
    write_rows(
        out,
        (
            check_terms(read_part(p, want, [g]), rules, takedowns, today)
            for p in parts
            for g in range(p.row_groups)
        ),
        REJECT_SCHEMA,
    )
    t = pq.read_table(out, columns=["source", "key"])
    return pc.binary_join_element_wise(t["source"], t["key"], "\0").combine_chunks()


def _dup_plan(cat: Path, dup_partitions, parts, new_parts, partition_rows: int):
    """(hash partitions, their scratch folder, created empty) for the duplicate checks; (0,
    None) when the driver runs them (see `validate_catalog`)."""
    if dup_partitions is not None and (
        isinstance(dup_partitions, bool)
        or not isinstance(dup_partitions, int)
        or dup_partitions < 0
    ):
        raise ValueError(f"dup_partitions: expected None or an int >= 0, got {dup_partitions!r}")
    if dup_partitions is None:
        new_rows = sum(p.rows for p in new_parts)
        dup_partitions = dup_partitions_for(sum(p.rows for p in parts), new_rows, partition_rows)
    if not dup_partitions:
        return 0, None
    hash_dir = cat / "dup-hashes"
    shutil.rmtree(hash_dir, ignore_errors=True)
    hash_dir.mkdir()
    return dup_partitions, hash_dir


def _find(
    parts,
    old_parts,
    new_parts,
    old_rows: int,
    rules: QualityConfig,
    columns,
    stage: Path,
    hash_dir: Path | None,
    dup_partitions: int,
    *,
    workers: int,
    dask_address: str | None,
    partition_rows: int,
    cache: Path | None = None,
) -> tuple[RowCheck, dict]:
    """The row-local rules on the new rows (their rejects staged; their hashes kept in the hash
    `cache`) and the duplicate checks against the whole view, reading the old rows' hashes
    from the cache where it has them: (the merged RowCheck, `cross_hits` of the new rows).

    On the driver, the duplicate search needs only the new rows' hashes, so it runs on a
    thread of its own while the row checks run: the checks' start (Great Expectations'
    import and context) is mostly one busy core, and the search uses the others."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="kiln-search") as pool:
        search = None
        if hash_dir is None and any(p.rows for p in new_parts):
            hashes = hash_columns(
                pd.concat([read_part(p, ["sha256", "phash"]) for p in new_parts], ignore_index=True)
            )
            batches = old_hash_batches(old_parts, new_parts, str(cache) if cache else None)
            search = pool.submit(cross_catalog, hashes, rules, batches, old_rows, workers=workers)
        checks, sample = _run_checks(
            _partitions(new_parts, partition_rows),
            rules,
            columns,
            workers,
            dask_address,
            stage,
            hash_dir,
            dup_partitions,
            cache,
        )
        new = _merge(checks, old_rows, sample)
        new.hashes = None
        release_freed_memory()
        if search is not None:
            cross = search.result()
        elif hash_dir is not None:
            files = [(str(hash_dir / f"{i:06d}.parquet"), c.rows) for i, c in enumerate(checks)]
            cross = partitioned_cross(
                hash_dir,
                files,
                _partitions(old_parts, partition_rows),
                rules.near_duplicate_distance,
                dup_partitions,
                workers=workers,
                dask_address=dask_address,
                cache=str(cache) if cache else None,
            )
        else:
            cross = CrossCheck(np.zeros(0, np.int64), np.zeros(0, np.int64))
    release_freed_memory()
    return new, cross_hits(new.rejected["pos"].to_numpy(np.int64), cross, rules, old_rows)


def _quarantine_record(layout: Layout, parts: list[ViewPart], rows: int) -> dict:
    """What a verdict's quarantine file was built from: the view's quarantine data files
    (Delta never rewrites one in place) and its row count."""
    table = table_path(layout, "quarantine")
    return {"parts": [[p.seq, p.path.relative_to(table).as_posix()] for p in parts], "rows": rows}


def _mergeable(
    layout: Layout, base: dict | None, parts: list[ViewPart], terms: Path
) -> Path | None:
    """The earlier verdict's quarantine file, when this run's can be merged from it and the
    rows after it (`write_quarantine`): the view's quarantine rows up to that verdict are the
    ones it was built from, and the licensing terms quarantine the same rows as then (else
    some of its rows would change reason or leave). None: rebuild it."""
    if base is None or "quarantine" not in base:
        return None
    path = layout.quality(base["id"]) / "quarantine.parquet"
    record = base["quarantine"]
    old = [p for p in parts if p.seq <= base["seq"]]
    if not path.is_file() or _quarantine_record(layout, old, record["rows"]) != record:
        return None
    if pq.ParquetFile(path).metadata.num_rows != record["rows"]:
        return None
    cols = REJECT_SCHEMA.names
    then = pq.read_table(
        base["rejects"], columns=cols, filters=[("reason", "in", sorted(TERMS_REASONS))]
    )
    now = pq.read_table(terms, columns=cols)
    order = [(c, "ascending") for c in cols]
    if not then.cast(REJECT_SCHEMA).sort_by(order).equals(now.cast(REJECT_SCHEMA).sort_by(order)):
        return None
    return path


def _write_rows(
    layout: Layout,
    ingest_id: str,
    stage: Path,
    base: dict | None,
    cross: tuple[Path, Path],
    terms: tuple[Path, pa.Array],
    sample: pd.DataFrame,
) -> tuple[int, pd.DataFrame, dict, dict]:
    """The verdict's rows streamed into place: `rejects.parquet` (the earlier verdict's, the
    staged partitions', the duplicates', less any row the licensing terms quarantine, then
    the terms' own), `near_duplicates.parquet`, `docs_sample.parquet`, the quarantine (merged
    from the earlier verdict's when `_mergeable`, else rebuilt from the whole view) and the
    Delta tables. Returns (rejects, the quarantine's counts by step and reason, the tables'
    versions, `_quarantine_record` of the quarantine)."""
    cat = layout.catalog(ingest_id)
    rows_files = sorted(stage.glob("rows-*.parquet"))
    rejects, flags = stage / REJECTS_FILE, stage / FLAGS_FILE
    n = write_rows(
        rejects,
        [*([base["rejects"]] if base else []), *rows_files, cross[0]],
        REJECT_SCHEMA,
        gone=terms[1],
        drop_reasons=TERMS_REASONS,
        then=[terms[0]],
    )
    write_rows(flags, [*([base["flags"]] if base else []), cross[1]], FLAG_SCHEMA)
    qparts = view_parts(layout, ingest_id, "quarantine")
    merge_from = _mergeable(layout, base, qparts, terms[0])
    if merge_from is not None and not merge_base(merge_from, quarantine_schema(qparts)):
        merge_from = None
    if merge_from is None:
        quarantine = write_quarantine(
            layout, ingest_id, rejects, layout.quality(ingest_id), parts=qparts
        )
    else:  # the rows this run adds: its new rows' rejects (no terms row: those are as before)
        task_logger(__name__).info("quarantine: %s's merged with the rows after it", base["id"])
        added = stage / "added-rejects.parquet"
        write_rows(added, [*rows_files, cross[0]], REJECT_SCHEMA, gone=terms[1])
        quarantine = write_quarantine(
            layout,
            ingest_id,
            added,
            layout.quality(ingest_id),
            base=merge_from,
            after_seq=base["seq"],
            parts=qparts,
        )
    release_freed_memory()
    rejects.replace(cat / REJECTS_FILE)
    flags.replace(cat / FLAGS_FILE)
    _write_parquet(
        sample.astype({c: object for c in sample.columns if sample[c].dtype == object}),
        cat / SAMPLE_FILE,
    )
    # The same rows as Delta tables (`verdict` = this ingest id), for other engines and SQL.
    tables = {
        t: write_verdict_table(layout, t, cat / f, ingest_id)
        for t, f in (("rejects", REJECTS_FILE), ("flags", FLAGS_FILE))
    }
    return n, quarantine, tables, _quarantine_record(layout, qparts, int(quarantine["n"].sum()))


def _result(
    ingest_id: str,
    rows: int,
    rejected: int,
    quarantine: pd.DataFrame,
    rules: QualityConfig,
    **extra,
) -> ValidateResult:
    """The gate's result from the quarantine's counts (`step`, `reason`, `n`)."""
    step = quarantine["step"]
    files_q = quarantine[~step.eq("ingest-manifest")]
    listed = rows + int(quarantine.loc[step.eq("ingest"), "n"].sum())
    reasons = files_q.dropna(subset=["reason"]).groupby("reason", sort=False)["n"].sum()
    reasons = reasons.sort_values(ascending=False, kind="stable")
    # Withdrawn and expired rows leave the data, but say nothing of its quality: the gate's
    # fraction counts the other reasons only.
    why = files_q["reason"]
    terms = int(files_q.loc[why.isin(list(TERMS_REASONS)), "n"].sum())
    quarantined = int(files_q["n"].sum())
    result = ValidateResult(
        ingest_id=ingest_id,
        listed=listed,
        clean=rows - rejected,
        rejected_ingest=listed - rows,
        rejected_validate=rejected,
        reject_fraction=round((quarantined - terms) / listed, 4) if listed else 0.0,
        max_reject_fraction=rules.max_reject_fraction,
        reasons={str(r): int(c) for r, c in reasons.items()},
        manifest_problems=int(quarantine.loc[step.eq("ingest-manifest"), "n"].sum()),
        takedowns=int(files_q.loc[why.eq("takedown"), "n"].sum()),
        license_expired=int(
            files_q.loc[why.isin(["license_expired", "license_end_invalid"]), "n"].sum()
        ),
        **extra,
    )
    assert result.clean + quarantined == listed, "clean + quarantined must equal files listed"
    return result


@task(name="validate-catalog", cache_policy=NO_CACHE)
def validate_catalog(
    root: str,
    ingest_id: str,
    rules: QualityConfig,
    *,
    allow_failed_gate: bool = False,
    dask_address: str | None = None,
    workers: int = 2,
    partition_rows: int = PARTITION_ROWS,
    dup_partitions: int | None = None,
) -> ValidateResult:
    """Run the suite on the view after `ingest_id`; raise QualityGateError past the threshold.

    Rows are checked a partition (`partition_rows`) at a time, `workers` partitions at once on
    local threads, or on the Dask cluster at `dask_address`. The duplicate checks run in
    `dup_partitions` hash-prefix partitions (tasks/quality/dup_search.py; None: one per about 500k
    rows when more than one partition of rows is new, else 0: on the driver, whose memory then
    holds the new rows' hashes and a row group of the old). When an earlier catalog of the
    chain was validated under the same rules and no accepted row has left the view since,
    only the rows ingested after it are checked, and compared with the others for duplicates:
    their hashes come from the hash cache (tasks/quality/hash_cache.py) that the row checks
    fill, and the quarantine is that verdict's merged with the new rows when nothing it was
    built from changed (`_mergeable`). The licensing terms (data_quality/terms.py: the
    takedown list, license ends) run on every row at every run and override the suite's
    reason; they are not counted in the gate's reject fraction.

    Writes, in `catalog/<ingest_id>/`, `rejects.parquet` (the rows this step quarantined),
    `near_duplicates.parquet` (near-duplicates kept), `docs_sample.parquet` and then
    `verdict.json` (passed, reject fraction, limit, reasons, the suite's key, the catalog table
    versions it checked, the quarantine data files its quarantine was built from); the
    rejects and flags also go to the Delta tables `catalog/tables/rejects` and `.../flags`
    (column `verdict`: the ingest id); and, in `quality/<ingest_id>/`, the Data Docs site,
    `quarantine.parquet` (every quarantined row of the view, ingest and validate steps),
    `quarantine_sample.parquet` (up to 20 rows a reason: what MLflow gets) and
    `summary.json`. All of it is written before the gate is checked. With
    `allow_failed_gate` a failed gate is logged instead of raised (the verdict still says
    failed, and the shard step needs the same override).

    Holds the catalog writer's lock (`<root>/.kiln-catalog.lock`) throughout, as ingest and
    compaction do: it commits to the rejects and flags tables and rewrites the verdict's
    files, so it waits for a running ingest, compaction or other validate of the root.
    """
    with catalog_writer(Path(root), f"kiln validate of {ingest_id}"):
        return _validate(
            root,
            ingest_id,
            rules,
            allow_failed_gate=allow_failed_gate,
            dask_address=dask_address,
            workers=workers,
            partition_rows=partition_rows,
            dup_partitions=dup_partitions,
        )


def _validate(
    root: str,
    ingest_id: str,
    rules: QualityConfig,
    *,
    allow_failed_gate: bool,
    dask_address: str | None,
    workers: int,
    partition_rows: int,
    dup_partitions: int | None,
) -> ValidateResult:
    """`validate_catalog`'s work, under the catalog writer's lock."""
    log = task_logger(__name__)
    layout = Layout(Path(root))
    cat = layout.catalog(ingest_id)
    if not (cat / "summary.json").is_file():
        raise MissingInput(
            f"no catalog view for ingest {ingest_id} under {root}: run `kiln ingest` first"
        )
    links = chain(layout, ingest_id)
    key = suite_key(rules)
    base = _base(layout, links, key)
    # An old verdict must never vouch for the rejects this run is about to write.
    (cat / VERDICT_FILE).unlink(missing_ok=True)
    parts = view_parts(layout, ingest_id, "accepted")
    columns = accepted_columns(layout, ingest_id, parts)
    if sum(p.rows for p in parts):
        check_columns(columns, rules)
    if rules.min_aesthetic is not None and rules.aesthetic_column not in columns:
        log.warning(
            "quality.min_aesthetic set, but no %r column: check skipped", rules.aesthetic_column
        )
    after = base["seq"] if base else 0
    old_parts = [p for p in parts if p.seq <= after]
    new_parts = [p for p in parts if p.seq > after]
    old_rows = int(base["rows"]) if base else 0
    dup_partitions, hash_dir = _dup_plan(cat, dup_partitions, parts, new_parts, partition_rows)
    cache = hash_cache.cache_root(layout)
    hash_cache.prune(cache, table_path(layout, "accepted"))
    stage = cat / "validate-stage"  # the verdict's rows, as they are found
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    try:
        new, hits = _find(
            parts,
            old_parts,
            new_parts,
            old_rows,
            rules,
            columns,
            stage,
            hash_dir,
            dup_partitions,
            workers=workers,
            dask_address=dask_address,
            partition_rows=partition_rows,
            cache=cache,
        )
        counts = dict(base["counts"]) if base else {}
        for r, n in {**new.counts, **hits["counts"]}.items():
            counts[r] = counts.get(r, 0) + n
        rows = old_rows + new.rows
        sample = _bounded_sample([base["sample"] if base else None, new.sample])
        if not len(sample) and rows:
            sample = check_rows(
                read_part(parts[0], columns, [0]).head(3), rules, gx_check=False, hashes=False
            ).sample
        near = int(base.get("near_duplicates", 0) if base else 0) + hits["near_duplicates"]
        qdir = layout.quality(ingest_id)
        shutil.rmtree(qdir, ignore_errors=True)  # a re-run rebuilds the docs, never appends
        qdir.mkdir(parents=True)
        docs = write_data_docs(qdir, rules, sample, counts, rows) if rows else None
        terms = stage / "terms.parquet"
        gone = _terms(root, parts, columns, rules, terms)
        cross = resolve_hits(parts, hits, rules.drop_near_duplicates, stage)
        release_freed_memory()
        rejected, quarantine, tables, qrecord = _write_rows(
            layout, ingest_id, stage, base, cross, (terms, gone), sample
        )
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    result = _result(
        ingest_id,
        rows,
        rejected,
        quarantine,
        rules,
        near_duplicates=near,
        expectations=expectation_summaries(rules, counts),
        data_docs=docs,
        checked_rows=new.rows,
        incremental_from=base["id"] if base else None,
    )
    files_q = result.listed - result.clean
    (qdir / "summary.json").write_text(json.dumps(result.to_dict(), indent=2))
    _write_verdict(
        cat / VERDICT_FILE,
        result,
        suite=key,
        rows=rows,
        counts=counts,
        near_duplicates=near,
        table_versions=view_versions(layout, ingest_id),
        verdict_table_versions=tables,
        quarantine=qrecord,
    )
    if not result.passed:
        msg = (
            f"quality gate failed for {ingest_id}: rejected {files_q}/{result.listed} files "
            f"({result.reject_fraction:.1%}) > quality.max_reject_fraction "
            f"({rules.max_reject_fraction:.1%})\n{reasons_table(result.reasons)}\n"
            f"quarantine: {qdir / 'quarantine.parquet'}"
        )
        if not allow_failed_gate:
            raise QualityGateError(msg)
        log.warning("%s\ncontinuing: %s was given", msg, OVERRIDE_FLAG)
        return result
    log.info(
        "validated %s: %d clean, %d quarantined; checked %d rows%s",
        ingest_id,
        result.clean,
        files_q,
        new.rows,
        f" (the rest were checked for {base['id']})" if base else "",
    )
    return result


def _pair_strings(source, key) -> np.ndarray:
    """`source` and `key` (columns, arrays or lists) joined per row, as Python strings."""
    return (
        pd.Series(source, dtype=object).astype(str).to_numpy(object)
        + "\0"
        + pd.Series(key, dtype=object).astype(str).to_numpy(object)
    )


def _pair_hashes(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two independent 64-bit hashes of each joined (source, key)."""
    return hash128(pairs, "kiln-pairs-hi-01", "kiln-pairs-lo-02")


class _Pairs:
    """The (source, key) pairs of a verdict file, as 128 bits each, sorted, with one column's
    values beside them: `find` looks a batch of rows up without holding the pairs' strings
    (16 bytes a pair, and the values' own)."""

    def __init__(self, path: Path, value: str | None = None) -> None:
        hi, lo, vals = [], [], []
        f = pq.ParquetFile(path)
        for b in f.iter_batches(columns=["source", "key", *([value] if value else [])]):
            h, g = _pair_hashes(
                _pair_strings(b.column("source").to_pylist(), b.column("key").to_pylist())
            )
            hi.append(h)
            lo.append(g)
            if value:
                vals.append(b.column(value))
        self.hi = np.concatenate(hi) if hi else np.zeros(0, np.uint64)
        self.lo = np.concatenate(lo) if lo else np.zeros(0, np.uint64)
        order = np.lexsort((self.lo, self.hi))
        self.hi, self.lo = self.hi[order], self.lo[order]
        self.values = pa.concat_arrays(vals).take(pa.array(order)) if vals else None

    def __len__(self) -> int:
        return len(self.hi)

    def find(self, source, key) -> np.ndarray:
        """Each row's position among the pairs (as sorted), -1 where it is not one."""
        hi, lo = _pair_hashes(_pair_strings(source, key))
        start = np.searchsorted(self.hi, hi, "left")
        stop = np.searchsorted(self.hi, hi, "right")
        out = np.full(len(hi), -1, np.int64)
        one = (stop - start) == 1
        first = np.minimum(start, max(len(self.hi) - 1, 0))
        hit = one & (self.lo[first] == lo) if len(self.hi) else one
        out[hit] = start[hit]
        for i in np.flatnonzero((stop - start) > 1):  # the high hash shared: rare
            same = np.flatnonzero(self.lo[start[i] : stop[i]] == lo[i])
            if len(same):
                out[i] = start[i] + same[0]
        return out


def scan_clean(root: str, ingest_id: str, columns: list[str] | None = None):
    """The clean rows of a validated catalog, a row group at a time: the view after
    `ingest_id` less the rows its verdict quarantined (only `columns`, when given). The
    verdict's rows are looked up by a 128-bit hash of their source and key (`_Pairs`), so
    memory holds 16 bytes a quarantined or flagged row, not their strings."""
    from tasks.catalog.view import scan_view

    layout = Layout(Path(root))
    cat = layout.catalog(ingest_id)
    gone = _Pairs(cat / REJECTS_FILE)
    need = None if columns is None else list(dict.fromkeys([*columns, "source", "key"]))
    if need is not None and "near_duplicate_of" in need:
        need.remove("near_duplicate_of")
    flags = None
    if columns is None or "near_duplicate_of" in columns:
        flags = _Pairs(cat / FLAGS_FILE, "near_duplicate_of")
    for batch in scan_view(layout, ingest_id, "accepted", need):
        if len(gone) and len(batch):
            batch = batch[gone.find(batch["source"], batch["key"]) < 0]
        if flags is not None:
            near = np.full(len(batch), np.nan, object)
            if len(flags) and len(batch):
                at = flags.find(batch["source"], batch["key"])
                hit = at >= 0
                near[hit] = flags.values.take(pa.array(at[hit])).to_numpy(zero_copy_only=False)
            batch = batch.assign(near_duplicate_of=near)
        yield batch if columns is None else batch[columns]


def read_clean(root: str, ingest_id: str, columns: list[str] | None = None) -> pd.DataFrame:
    """The clean rows of a validated catalog as one frame (see `scan_clean`)."""
    layout = Layout(Path(root))
    if not (layout.catalog(ingest_id) / REJECTS_FILE).is_file():
        raise MissingInput(
            f"catalog {ingest_id} has not been validated "
            f"({layout.catalog(ingest_id) / REJECTS_FILE} missing): run `kiln validate` first"
        )
    got = [b for b in scan_clean(root, ingest_id, columns) if len(b)]
    if got:
        return pd.concat(got, ignore_index=True)
    return pd.DataFrame(columns=columns or accepted_columns(layout, ingest_id))
